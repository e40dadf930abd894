"""Multi-LoRA serving across real processes: three PEFT adapters of different ranks and targets
and the base model in one batch give the same greedy tokens on a colocated worker and through
prefill + decode on mooncake (the colocated engine equals HF on PEFT's merged weights:
tests/engine/test_lora.py), twice (the second time with prefix hits); a prefill lacking the
request's adapter refuses it naming the adapter; the gateway picks the adapter by `model` or
`lora_path` and answers 404 for an unknown one. Afterwards every worker's pages are idle."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from protos.v1 import worker_pb2_grpc
from services.common.channels import open_channel
from services.common.security import GrpcSecurity
from tests.e2e.cluster import Cluster, wait_until, worker_args
from tests.e2e.test_pd_services import assert_pages_idle, prompts_of
from tests.e2e.worker_client import Result, generate
from tests.engine.lora_adapters import SPECS, write_adapter

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

NEW_TOKENS = 8
KEY = "lora-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
POOL = ("--num-pages", "256", "--chunked-prefill-size", "64")


async def _run(address: str, jobs: list[tuple[list[int], str]], prefill: str | None = None) -> list[Result]:
    """Every (prompt, adapter) at once on one channel, so the worker batches them."""
    async with open_channel(address, GrpcSecurity()) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        return list(await asyncio.gather(*(generate(stub, prompt, prefill=prefill, lora=lora,
                                                    max_new_tokens=NEW_TOKENS) for prompt, lora in jobs)))


def run(address: str, jobs: list[tuple[list[int], str]], prefill: str | None = None) -> list[Result]:
    return asyncio.run(_run(address, jobs, prefill))


def test_adapters_colocated_pd_and_gateway(cluster: Cluster, tiny_model, tmp_path):
    adapters = {spec.name: write_adapter(tiny_model, tmp_path / spec.name, spec) for spec in SPECS}
    every = ("--enable-lora", "--max-lora-rank", "16", "--max-loras-per-batch", "4", "--lora-paths",
             *(f"{name}={path}" for name, path in adapters.items()))
    # the prefill lacks mlp16: decode, which has it, must learn of the refusal
    some = ("--enable-lora", "--max-lora-rank", "16", "--lora-paths",
            *(f"{name}={adapters[name]}" for name in ("qv4", "all8")))
    bootstrap = cluster.bootstrap()
    colocated, prefill, decode = cluster.start_many([
        ("colocated", worker_args(tiny_model, "null", extra=(*POOL, *every))),
        ("prefill", worker_args(tiny_model, "prefill", backend="mooncake", bootstrap=bootstrap,
                                extra=(*POOL, *some))),
        ("decode", worker_args(tiny_model, "decode", backend="mooncake", bootstrap=bootstrap,
                               extra=(*POOL, *every))),
    ])
    gateway = cluster.start("gateway", ["launch-router", "--model-path", str(tiny_model), "--port", "0",
                                        "--worker", f"http://{colocated.address}", "--enable-lora",
                                        "--api-key", KEY])
    prompts = prompts_of([9, 40], seed=3)
    jobs = [(prompt, name) for name in ("", "qv4", "all8", "mlp16") for prompt in prompts]
    expected = run(colocated.address, jobs)
    assert all(r.code is None for r in expected), [r.details for r in expected]
    assert len({tuple(r.tokens) for r in expected[1::2]}) == 4  # each adapter answers its own way
    for name in ("qv4", "all8", "mlp16"):  # per-adapter counters (the base's requests are not counted)
        assert colocated.metric("pdserve:lora_requests_total", adapter=name) == 2
        assert colocated.metric("pdserve:lora_generation_tokens_total", adapter=name) == 2 * NEW_TOKENS

    pd_jobs = jobs[:6]  # the base, qv4 and all8: what the prefill holds
    for _ in range(2):  # the second round hits the pages the first cached, on both sides
        got = run(decode.address, pd_jobs, prefill=prefill.address)
        assert [r.tokens for r in got] == [r.tokens for r in expected[:6]], [r.details for r in got]
    assert decode.metric("pdserve:kv_transfer_bytes_saved_total") > 0

    (refused,) = run(decode.address, [(prompts[0], "mlp16")], prefill=prefill.address)
    assert refused.code is not None and "mlp16" in refused.details, (refused.code, refused.details)
    (unknown,) = run(colocated.address, [(prompts[0], "nope")])
    assert unknown.code == grpc.StatusCode.NOT_FOUND and "nope" in unknown.details

    url = f"http://{gateway.address}"
    with httpx.Client(timeout=60, headers=AUTH) as client:
        for index, name in ((2, "qv4"), (6, "mlp16"), (0, "")):
            sampling = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
            body = {"input_ids": prompts[0], "sampling_params": sampling}
            native = client.post(f"{url}/generate", json={**body, "lora_path": name or None}).json()
            assert native["output_ids"] == expected[index].tokens, name
            completion = client.post(f"{url}/v1/completions", json={
                "model": name or tiny_model.name, "prompt": prompts[0], "max_tokens": NEW_TOKENS,
                "temperature": 0, "ignore_eos": True})
            assert completion.status_code == 200, completion.text
            assert completion.json()["choices"][0]["text"] == native["text"]
        missing = client.post(f"{url}/v1/completions",
                              json={"model": "nope", "prompt": "hi", "max_tokens": 2})
        assert missing.status_code == 404, missing.text
        assert missing.json()["error"]["code"] == "model_not_found"
        models = client.get(f"{url}/v1/models").json()["data"]
        assert [m["id"] for m in models] == [tiny_model.name, "all8", "mlp16", "qv4"]
        assert {m.get("parent") for m in models[1:]} == {tiny_model.name}
        check_load_and_unload(client, url, colocated, adapters["qv4"], prompts[0], expected[2].tokens)
    assert_pages_idle(colocated, prefill, decode)


def check_load_and_unload(client: httpx.Client, url: str, colocated, qv4_path, prompt: list[int],
                          qv4_tokens: list[int]):
    """Load a copy of qv4 as `late` at run time (behind the API key), use it, see its unload refused
    while a request runs under it and the running request unaffected, then unload it: 404 after."""
    load = {"lora_name": "late", "lora_path": str(qv4_path)}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=load).status_code == 401  # no key
    response = client.post(f"{url}/v1/load_lora_adapter", json=load)
    assert response.status_code == 200, response.text
    assert client.post(f"{url}/v1/load_lora_adapter", json=load).status_code == 400  # the name is taken
    bad = client.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nonexistent"})
    assert bad.status_code == 400 and "missing" in bad.json()["error"]["message"]

    def long_run() -> dict:
        body = {"input_ids": prompt, "lora_path": "late",
                "sampling_params": {"temperature": 0, "max_new_tokens": 300, "ignore_eos": True}}
        return client.post(f"{url}/generate", json=body).json()

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(long_run)
        wait_until(lambda: colocated.metric("pdserve:num_running_reqs") > 0, 30, "the request under `late`")
        refused = client.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"})
        assert refused.status_code == 409, refused.text
        result = running.result()
    assert result["output_ids"][:NEW_TOKENS] == qv4_tokens  # the same weights as qv4
    assert client.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
    gone = client.post(f"{url}/generate", json={"input_ids": prompt, "lora_path": "late"})
    assert gone.status_code == 404, gone.text
