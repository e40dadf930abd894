"""Expert-parallel workers served disaggregated, as real processes, through the gateway.

A prefill worker at `--tp 2 --ep 2` and a decode worker at `--tp 2 --moe-a2a-backend deepep`
(EP over both ranks, run on torch.distributed's all-to-all, which the decode worker says at start)
on mooncake, behind `launch-router --pd-disaggregation`: chat completions through the openai
client equal a colocated TP 1 worker's behind its own gateway, and prompts of 1 to 130 tokens
(prefill chunks of 64) give the same tokens as on the colocated worker. Both EP workers report
their all-to-all traffic and the tokens per EP rank.
"""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.cluster import Cluster, wait_until, worker_args
from tests.e2e.test_gateway_model_from_workers import _chat_stream
from tests.e2e.test_moe_mla_pd import deepseek_model, moe_model, prompts_of  # noqa: F401 (fixtures)
from tests.e2e.worker_client import run_all

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

CHUNK = ("--chunked-prefill-size", "64", "--num-pages", "128")
CHATS = ("Tell me about the river.", "Write a poem about the sea, please.")


# The MoE model in `make test-all` only: DeepSeek's experts go the same way, behind MLA.
@pytest.mark.parametrize("model_name", [pytest.param("moe_model", marks=pytest.mark.long), "deepseek_model"])
def test_ep_prefill_to_deepep_decode_matches_colocated_tp1(cluster: Cluster, model_name, request):
    model = request.getfixturevalue(model_name)
    prefill, decode, colocated = cluster.start_many([
        ("prefill", worker_args(model, "prefill", backend="mooncake",
                                extra=(*CHUNK, "--tp", "2", "--ep", "2"))),
        ("decode", worker_args(model, "decode", backend="mooncake",
                               extra=(*CHUNK, "--tp", "2", "--moe-a2a-backend", "deepep"))),
        ("colocated", worker_args(model, "null", extra=CHUNK)),
    ])
    assert ("--moe-a2a-backend deepep: DeepEP needs NVIDIA GPUs with NVSHMEM; `import deep_ep` failed"
            in decode.log())
    assert ("using torch.distributed all_to_all over gloo instead: identical output, only speed differs"
            in decode.log())

    prompts = prompts_of([1, 17, 64, 130], seed=31)
    pd = run_all(decode.address, prompts, [prefill.address] * len(prompts), max_new_tokens=8)
    reference = run_all(colocated.address, prompts, max_new_tokens=8)
    for index, (got, expected) in enumerate(zip(pd, reference, strict=True)):
        assert got.code is None and expected.code is None, f"prompt {index}: {got.details} {expected.details}"
        assert got.tokens == expected.tokens, f"prompt {index}: EP PD differs from colocated TP 1"

    gateway, reference_gateway = cluster.start_many([
        ("gateway", ["launch-router", "--pd-disaggregation", "--prefill", f"http://{prefill.address}", "8998",
                     "--decode", f"http://{decode.address}", "--host", "127.0.0.1", "--port", "0"]),
        ("gateway-ref", ["launch-router", "--model-path", str(model), "--port", "0",
                         "--worker", f"http://{colocated.address}"])])
    wait_until(lambda: httpx.get(f"http://{gateway.address}/health", timeout=5).status_code == 200, 60,
               "the gateway to become healthy")
    for content in CHATS:
        pd_text = _chat_stream(gateway.address, model.name, content)
        assert pd_text and pd_text == _chat_stream(reference_gateway.address, model.name, content)

    for worker in (prefill, decode):
        assert worker.metric("pdserve:moe_a2a_bytes_total", direction="sent") > 0
        assert worker.metric("pdserve:moe_ep_rank_tokens_total", ep_rank="1") > 0
        wait_until(lambda worker=worker: worker.metric("pdserve:kv_pages_used") == 0, 30,
                   f"{worker.name}'s pages to be free")
