"""LoRA adapters across a fleet the registry lists: 1 prefill + 2 decodes on NIXL and a gateway
watching the registry (plus a colocated worker outside it, the reference), one deployment for
every check:

- three adapters of different ranks and targets and the base model in one batch give HF
  transformers' greedy tokens on PEFT's merged weights on the colocated worker and through prefill
  + decode on nixl, twice (the second time with prefix hits);
- decode and prefill each refuse, naming it, an adapter the other side lacks, and the prefill one it
  holds from other files than decode (naming both keys);
- the gateway routes an adapter only to workers and pairs holding it (decode-b lacks mlp16: every
  mlp16 request succeeds, none reaches it), answers 404 in vLLM's words when no route holds it (an
  adapter only decode-a holds included), lists what the fleet serves in /v1/models, and loads and
  unloads an adapter on every worker, routing to it as soon as the load answers;
- a request for an adapter no worker holds makes the workers load it from their --lora-resolver-dir
  (concurrent requests for it all served, one load), and a name outside that directory stays a 404;
- a request whose decode is killed mid-stream continues on the other decode, with its adapter's
  weights: the text equals a fault-free run's.
Afterwards every surviving worker's pages are idle."""

from __future__ import annotations

import asyncio
import re
import shutil
import signal

import grpc
import httpx
import pytest

from protos.v1 import worker_pb2, worker_pb2_grpc
from services.common.channels import open_channel
from services.common.security import GrpcSecurity
from tests.e2e.cluster import Cluster, Proc, wait_until, worker_args
from tests.e2e.test_lora import run
from tests.e2e.test_pd_services import assert_pages_idle, prompts_of
from tests.engine.lora_adapters import SPECS, merged_reference, write_adapter

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

NEW_TOKENS = 8
BACKEND = "nixl"
POOL = ("--num-pages", "256", "--chunked-prefill-size", "64")
LONG_TOKENS = 400  # the migrated stream: still running on its decode when the kill comes
KILL_FROM = 2  # the first chunk after which its decode is looked for (and killed)


def lora_flags(adapters: dict, names) -> tuple[str, ...]:
    return ("--enable-lora", "--max-lora-rank", "16", "--max-loras-per-batch", "4", "--lora-paths",
            *(f"{name}={adapters[name]}" for name in names))


def admin(worker: Proc, method: str, message) -> None:
    """A LoRA admin call straight to one worker (the prefill serves them on its Prefill service)."""
    async def call() -> None:
        async with open_channel(worker.address, GrpcSecurity()) as channel:
            stub = worker_pb2_grpc.PrefillStub if worker.name == "prefill" else worker_pb2_grpc.WorkerStub
            await getattr(stub(channel), method)(message, timeout=60)

    asyncio.run(call())


def test_adapters_across_a_registered_nixl_fleet(cluster: Cluster, tiny_model, tmp_path):
    adapters = {spec.name: write_adapter(tiny_model, tmp_path / spec.name, spec) for spec in SPECS}
    resolver = tmp_path / "resolver"  # on demand: `ondemand` (qv4's files); qv4's own folder is outside
    shutil.copytree(adapters["qv4"], resolver / "ondemand")
    on_demand = ("--lora-resolver-dir", str(resolver))
    every = lora_flags(adapters, adapters)
    bootstrap = cluster.bootstrap()
    prefill, decode_a, decode_b, colocated = cluster.start_many([
        ("prefill", worker_args(tiny_model, "prefill", backend=BACKEND, bootstrap=bootstrap,
                                extra=(*POOL, *every, *on_demand))),
        ("decode-a", worker_args(tiny_model, "decode", backend=BACKEND, bootstrap=bootstrap,
                                 extra=(*POOL, *every, *on_demand))),
        ("decode-b", worker_args(tiny_model, "decode", backend=BACKEND, bootstrap=bootstrap,
                                 extra=(*POOL, *lora_flags(adapters, ("qv4", "all8")), *on_demand))),
        ("colocated", worker_args(tiny_model, "null", extra=(*POOL, *every))),  # unregistered: not routed to
    ])
    gateway = cluster.start("gateway", ["launch-router", "--model-path", str(tiny_model), "--port", "0",
                                        "--bootstrap", bootstrap.address, "--enable-lora",
                                        "--policy", "round_robin"])
    url = f"http://{gateway.address}"
    wait_until(lambda: httpx.get(f"{url}/health", timeout=5).json().get("workers")
               == {"prefill": 1, "decode": 2, "colocated": 0}, 60, "the gateway to see every worker")

    prompts = prompts_of([9, 40], seed=5)
    names = ("", "qv4", "all8", "mlp16")
    specs = {spec.name: spec for spec in SPECS}
    expected = [tokens for name in names
                for tokens in merged_reference(tiny_model, specs.get(name), prompts, NEW_TOKENS)]
    jobs = [(prompt, name) for name in names for prompt in prompts]
    assert len({tuple(t) for t in expected[1::2]}) == 4  # each adapter answers its own way
    got = run(colocated.address, jobs)
    assert [r.tokens for r in got] == expected, [r.details for r in got]
    for _ in range(2):  # the second round hits the pages the first cached, on both sides
        got = run(decode_a.address, jobs, prefill=prefill.address)
        assert [r.tokens for r in got] == expected, [r.details for r in got]
    assert decode_a.metric("pdserve:kv_transfer_bytes_saved_total") > 0

    with httpx.Client(timeout=60) as client:
        check_refusals(client, url, prefill, decode_a, decode_b, adapters, prompts[0])
        check_routing(client, url, decode_b, prompts, expected)
        check_load_and_unload(client, url, adapters["qv4"], prompts[0], expected[2])
        check_on_demand(url, prompts[0], expected[2])
        check_migration(client, url, [decode_a, decode_b])
    assert_pages_idle(*(proc for proc in (prefill, decode_a, decode_b, colocated) if proc.alive()))


def check_refusals(client: httpx.Client, url: str, prefill: Proc, decode_a: Proc, decode_b: Proc,
                   adapters: dict, prompt: list[int]):
    """decode-b lacks mlp16 (the prefill holds it); the prefill lacks `solo` (loaded on decode-a
    alone) and holds `twin` from other files than decode-a: each refusal names the adapter, the
    gateway routes neither `solo` nor `twin` (no pair holds it whole: its own 404), and no refusal
    keeps a page."""
    (refused,) = run(decode_b.address, [(prompt, "mlp16")], prefill=prefill.address)
    assert refused.code == grpc.StatusCode.NOT_FOUND and "mlp16" in refused.details, refused.details
    solo = worker_pb2.LoadLoraAdapterRequest(lora_name="solo", lora_path=str(adapters["qv4"]))
    admin(decode_a, "LoadLoraAdapter", solo)
    (refused,) = run(decode_a.address, [(prompt, "solo")], prefill=prefill.address)
    # the prefill's refusal, relayed by decode as retryable on another pair
    assert refused.code == grpc.StatusCode.UNAVAILABLE, (refused.code, refused.details)
    assert "The model `solo` does not exist" in refused.details and "prefill" in refused.details
    assert_unknown(client, url, "solo")
    # `twin`: one name, other files on each side: the prefill refuses decode's handshake, naming both
    for worker, path in ((prefill, adapters["all8"]), (decode_a, adapters["qv4"])):
        twin = worker_pb2.LoadLoraAdapterRequest(lora_name="twin", lora_path=str(path))
        admin(worker, "LoadLoraAdapter", twin)
    (refused,) = run(decode_a.address, [(prompt, "twin")], prefill=prefill.address)
    assert refused.code == grpc.StatusCode.FAILED_PRECONDITION, (refused.code, refused.details)
    assert "LoRA adapter 'twin' differs between prefill and decode" in refused.details, refused.details
    assert len(set(re.findall(r"twin@[0-9a-f]+", refused.details))) == 2, refused.details
    assert_unknown(client, url, "twin")  # the gateway pairs neither
    for worker, name in ((decode_a, "solo"), (decode_a, "twin"), (prefill, "twin")):
        unload = worker_pb2.UnloadLoraAdapterRequest(lora_name=name)
        admin(worker, "UnloadLoraAdapter", unload)
    assert_pages_idle(prefill, decode_a, decode_b)  # no refusal kept a page


def check_routing(client: httpx.Client, url: str, decode_b: Proc, prompts, expected):
    sampling = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    for _ in range(2):  # round robin, but over decode-a alone: never decode-b
        for index, prompt in enumerate(prompts):
            answer = client.post(f"{url}/generate", json={"input_ids": prompt, "lora_path": "mlp16",
                                                          "sampling_params": sampling})
            assert answer.status_code == 200, answer.text
            assert answer.json()["output_ids"] == expected[6 + index]
    assert decode_b.metric("pdserve:lora_requests_total", adapter="mlp16") == 0
    assert_unknown(client, url, "nope")
    models = client.get(f"{url}/v1/models").json()["data"]
    assert [m["id"] for m in models][1:] == ["all8", "mlp16", "qv4"]


def assert_unknown(client: httpx.Client, url: str, name: str) -> None:
    missing = client.post(f"{url}/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2})
    assert missing.status_code == 404, missing.text
    assert missing.json()["error"] == {"message": f"The model `{name}` does not exist.",
                                       "type": "not_found_error", "param": "model", "code": "model_not_found"}


def check_load_and_unload(client: httpx.Client, url: str, qv4_path, prompt: list[int], qv4_tokens: list[int]):
    """`late` (qv4's files) loaded through the gateway reaches every worker: requests for it are
    routed (to pairs too) at once; after the unload the gateway itself answers 404."""
    response = client.post(f"{url}/v1/load_lora_adapter",
                           json={"lora_name": "late", "lora_path": str(qv4_path)})
    assert response.status_code == 200, response.text
    body = {"input_ids": prompt, "lora_path": "late",
            "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}}
    for _ in range(2):  # decode-a and decode-b in turn
        answer = client.post(f"{url}/generate", json=body)
        assert answer.status_code == 200 and answer.json()["output_ids"] == qv4_tokens, answer.text
    assert "late" in [m["id"] for m in client.get(f"{url}/v1/models").json()["data"]]
    taken = client.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(qv4_path)})
    assert taken.status_code == 400 and taken.text.count("already loaded") == 3, taken.text  # names each
    assert client.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
    assert client.post(f"{url}/generate", json=body).status_code == 404


def check_on_demand(url: str, prompt: list[int], qv4_tokens: list[int]):
    """Three requests at once for `ondemand`, which no worker holds: the gateway has every worker
    load it from its --lora-resolver-dir and all three get qv4's tokens; `../qv4` (a real adapter
    folder, outside the directory) is not found, in vLLM's words."""
    body = {"input_ids": prompt, "lora_path": "ondemand",
            "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}}

    async def together() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(client.post(f"{url}/generate", json=body) for _ in range(3)))

    for answer in asyncio.run(together()):
        assert answer.status_code == 200 and answer.json()["output_ids"] == qv4_tokens, answer.text
    with httpx.Client(timeout=60) as client:
        assert "ondemand" in [m["id"] for m in client.get(f"{url}/v1/models").json()["data"]]
        assert_unknown(client, url, "../qv4")
        assert client.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "ondemand"}).status_code == 200


def check_migration(client: httpx.Client, url: str, decodes: list[Proc]):
    """A long all8 stream; its decode is killed mid-stream: the request continues on the other one
    with all8's weights (the text of a fault-free run, not the base model's)."""
    def stream(model: str, kill: bool = False, max_tokens: int = LONG_TOKENS) -> str:
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        text, received, killed = "", 0, not kill
        with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = httpx.Response(200, content=line[len("data: "):]).json()
                assert "error" not in chunk, chunk
                text += chunk["choices"][0]["text"]
                received += 1
                if not killed and received >= KILL_FROM:
                    serving = [d for d in decodes if d.metric("pdserve:num_running_reqs") > 0]
                    assert len(serving) <= 1, [d.name for d in serving]
                    if serving:
                        serving[0].kill(signal.SIGKILL)
                        killed = True
        assert killed, "the stream ended before its decode could be killed"
        return text

    expected = stream("all8")
    assert not expected.startswith(stream("tiny", max_tokens=16))  # the adapter's weights decide the text
    assert stream("all8", kill=True) == expected
    migrations = httpx.get(f"{url}/metrics").text
    assert any(line.startswith("pdserve:gateway_migrations_total") and not line.endswith(" 0.0")
               for line in migrations.splitlines()), migrations
