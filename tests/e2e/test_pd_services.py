"""Registry + prefill + decode as real processes, driven through the worker gRPC API.

Greedy output of 16 concurrent requests (1 to 600 tokens, prefill chunks of 64) through PD equals
the colocated worker's and HF transformers', on every real transfer backend and with 2 prefill +
2 decode workers. After the requests, every worker's KV pages in use (read from /metrics) are back
at zero.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from protos.v1 import bootstrap_pb2, bootstrap_pb2_grpc, common_pb2
from tests.e2e.cluster import Cluster, Proc, wait_until, worker_args
from tests.e2e.worker_client import run_all

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

LENGTHS = [1, 2, 5, 15, 16, 17, 33, 64, 65, 100, 129, 200, 257, 333, 450, 600]
NEW_TOKENS = 16
CHUNK = ("--chunked-prefill-size", "64", "--num-pages", "512")
LOGPROB_TOLERANCE = 1e-3


def prompts_of(lengths: list[int], seed: int = 11) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 4000, (n,), generator=generator).tolist() for n in lengths]


def pages_in_use(proc: Proc) -> float:
    return proc.metric("pdserve:kv_pages_used")


def assert_pages_idle(*procs: Proc, timeout_s: float = 30.0) -> None:
    for proc in procs:
        wait_until(lambda proc=proc: pages_in_use(proc) == 0, timeout_s, f"{proc.name}'s KV pages to be free")


@pytest.fixture(scope="module")
def reference(tiny_model, tmp_path_factory):
    """Greedy tokens and logprobs of the colocated worker and of HF transformers for PROMPTS."""
    prompts = prompts_of(LENGTHS)
    with Cluster(tmp_path_factory.mktemp("colocated")) as cluster:
        colocated = cluster.worker("colocated", tiny_model, "null", extra=CHUNK)
        results = run_all(colocated.address, prompts, max_new_tokens=NEW_TOKENS)
    assert all(r.code is None for r in results), [r.details for r in results if r.code]
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # the requests run with ignore_eos
    hf = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=0)
            hf.append(out[0, len(prompt):].tolist())
    return prompts, results, hf


def check_against_reference(got, reference) -> None:
    prompts, colocated, hf = reference
    for length, result, col, hf_tokens in zip(LENGTHS, got, colocated, hf, strict=True):
        assert result.code is None, f"prompt of {length} tokens failed: {result.code} {result.details}"
        assert result.tokens == col.tokens, f"prompt of {length} tokens: PD differs from colocated"
        assert result.tokens == hf_tokens, f"prompt of {length} tokens: PD differs from HF transformers"
        worst = max(abs(a - b) for a, b in zip(result.logprobs, col.logprobs, strict=True))
        assert worst < LOGPROB_TOLERANCE, f"prompt of {length} tokens: logprobs off by {worst}"


def list_workers(bootstrap: Proc) -> list[bootstrap_pb2.WorkerInfo]:
    async def call():
        async with grpc.aio.insecure_channel(bootstrap.address) as channel:
            return (await bootstrap_pb2_grpc.BootstrapStub(channel).List(bootstrap_pb2.ListRequest())).workers
    return list(asyncio.run(call()))


@pytest.mark.parametrize("backend", ["mooncake", "nixl", "ucx"])
def test_one_prefill_one_decode_matches_colocated_and_hf(backend, cluster: Cluster, tiny_model, reference):
    bootstrap = cluster.bootstrap()
    prefill, decode = cluster.start_many([
        ("prefill", worker_args(tiny_model, "prefill", backend=backend, bootstrap=bootstrap, extra=CHUNK)),
        ("decode", worker_args(tiny_model, "decode", backend=backend, bootstrap=bootstrap,
                               extra=(*CHUNK, "--decode-log-interval", "0.2"))),
    ])
    roles = sorted(w.role for w in list_workers(bootstrap))
    assert roles == [common_pb2.WORKER_ROLE_PREFILL, common_pb2.WORKER_ROLE_DECODE]

    prompts = reference[0]
    got = run_all(decode.address, prompts, [prefill.address] * len(prompts), max_new_tokens=NEW_TOKENS)
    check_against_reference(got, reference)
    assert prefill.metric("pdserve:kv_transfer_bytes_total") > 0
    assert decode.metric("pdserve:request_success_total", finish_reason="length") == len(prompts)
    assert "Decode batch, #running-req: " in decode.log() and "gen throughput (token/s): " in decode.log()
    assert "cuda graph: False, " in decode.log()  # CPU: no graphs (SGLang says True for a captured step)
    # The start line names the pool's device; tests/gpu/test_pd_gpu.py reads the GPU from it.
    assert "tokens on cpu, " in decode.log() and f", transfer backend {backend}, " in decode.log()
    assert_pages_idle(prefill, decode)


def test_two_prefill_two_decode_matches_colocated(cluster: Cluster, tiny_model, reference):
    bootstrap = cluster.bootstrap()
    p0, p1, d0, d1 = cluster.start_many([
        (name, worker_args(tiny_model, mode, backend="mooncake", bootstrap=bootstrap, extra=CHUNK))
        for name, mode in (("prefill0", "prefill"), ("prefill1", "prefill"), ("decode0", "decode"),
                           ("decode1", "decode"))])
    assert len(list_workers(bootstrap)) == 4
    prompts = reference[0]

    async def both_decodes():
        from tests.e2e.worker_client import generate_all
        half = len(prompts) // 2
        # Each decode gets half the prompts, alternating prefill workers: all four pairs are used.
        first = generate_all(d0.address, prompts[:half], [(p0, p1)[i % 2].address for i in range(half)],
                             max_new_tokens=NEW_TOKENS)
        second = generate_all(d1.address, prompts[half:], [(p1, p0)[i % 2].address for i in range(half)],
                              max_new_tokens=NEW_TOKENS)
        a, b = await asyncio.gather(first, second)
        return a + b

    check_against_reference(asyncio.run(both_decodes()), reference)
    for prefill in (p0, p1):
        assert prefill.metric("pdserve:kv_transfer_bytes_total") > 0
    assert_pages_idle(p0, p1, d0, d1)


def test_kv_layout_mismatch_is_refused_naming_both(cluster: Cluster, tiny_model):
    prefill, decode = cluster.start_many([
        ("prefill", worker_args(tiny_model, "prefill", backend="mooncake", extra=("--page-size", "16"))),
        ("decode", worker_args(tiny_model, "decode", backend="mooncake", extra=("--page-size", "32"))),
    ])
    (result,) = run_all(decode.address, [list(range(10, 50))], [prefill.address])
    assert result.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "page_size: 16 vs 32" in result.details, result.details
    assert_pages_idle(prefill, decode)
