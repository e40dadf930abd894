"""LoRA adapters in routing: the registry's lists of each worker's adapters reach the pool; a request
for an adapter goes only to workers (and prefill/decode pairs) holding it, a 404 in vLLM's words when
no route holds it; cache_aware scores a prompt under an adapter only against that adapter's pages."""

from __future__ import annotations

import pytest

from pdserve.page_hash import page_hashes, with_adapter
from protos.v1 import bootstrap_pb2, common_pb2
from services.gateway.discovery import RegistryDiscovery
from services.gateway.policies import CacheAwarePolicy, RoundRobinPolicy
from services.gateway.workers import (
    NoWorkersError,
    Router,
    UnknownAdapterError,
    WorkerPool,
    listed_adapters,
    servable_adapters,
)
from tests.services.gateway.test_policies import workers

JOINED, UPDATED = bootstrap_pb2.WORKER_EVENT_TYPE_JOINED, bootstrap_pb2.WORKER_EVENT_TYPE_UPDATED


def held(*names: str) -> dict[str, str]:
    return {name: f"{name}@digest" for name in names}


def test_registry_events_carry_each_workers_adapters() -> None:
    pool = WorkerPool()
    discovery = RegistryDiscovery(pool, "127.0.0.1:1", "m")

    def event(kind: int, *names: str) -> bootstrap_pb2.WorkerEvent:
        info = bootstrap_pb2.WorkerInfo(
            worker_id="w-1", role=common_pb2.WORKER_ROLE_COLOCATED, model="m", grpc_address="127.0.0.1:5",
            lora_adapters=[common_pb2.LoraAdapterRef(name=n, cache_key=f"{n}@d") for n in names])
        return bootstrap_pb2.WorkerEvent(type=kind, worker=info)

    discovery.apply(event(JOINED, "a", "b"))
    worker = pool.get("127.0.0.1:5")
    assert worker is not None and worker.lora_adapters == {"a": "a@d", "b": "b@d"}
    discovery.apply(event(UPDATED, "b"))  # `a` unloaded at run time
    assert pool.get("127.0.0.1:5") is worker and worker.lora_adapters == {"b": "b@d"}
    assert not worker.serves("a") and worker.serves("b") and worker.serves(None)
    assert pool.add("127.0.0.1:6", "colocated", "m", static=True).serves("anything")  # not known: asked


def test_only_workers_holding_the_adapter_are_picked() -> None:
    pool = WorkerPool()
    pool.add("127.0.0.1:1", "colocated", "m", lora_adapters=held("x"))
    pool.add("127.0.0.1:2", "colocated", "m", lora_adapters=held())
    pool.add("127.0.0.1:3", "colocated", "m", lora_adapters=held("x", "y"))
    router = Router(pool, RoundRobinPolicy(), RoundRobinPolicy())
    picked = set()
    for _ in range(6):
        route = router.pick("m", [1, 2], lora="x")
        picked.add(route.decode.address)
        route.finish(succeeded=True)
    assert picked == {"127.0.0.1:1", "127.0.0.1:3"}
    assert {router.pick("m", [1], lora="y").decode.address for _ in range(3)} == {"127.0.0.1:3"}
    assert len({router.pick("m", [1]).decode.address for _ in range(3)}) == 3  # the base: every one
    with pytest.raises(UnknownAdapterError) as missing:
        router.pick("m", [1], lora="nope")
    assert (missing.value.status, missing.value.code) == (404, "model_not_found")
    assert missing.value.message == "The model `nope` does not exist."
    # held, but its only worker failed this request already: unavailable (503), not unknown
    with pytest.raises(NoWorkersError) as busy:
        router.pick("m", [1], exclude={"127.0.0.1:3"}, lora="y")
    assert busy.value.status == 503 and not isinstance(busy.value, UnknownAdapterError)


def test_a_pd_pair_serves_an_adapter_only_when_both_sides_hold_it() -> None:
    pool = WorkerPool()
    pool.add("127.0.0.1:1", "prefill", "m", lora_adapters=held("x"))
    pool.add("127.0.0.1:2", "prefill", "m", lora_adapters=held("x", "y"))
    pool.add("127.0.0.1:3", "decode", "m", lora_adapters=held("x", "y", "z"))
    pool.add("127.0.0.1:4", "decode", "m", lora_adapters=held("x"))
    router = Router(pool, RoundRobinPolicy(), RoundRobinPolicy())
    routes = [router.pick("m", [1], lora="y") for _ in range(4)]
    assert {(r.prefill.address if r.prefill else None, r.decode.address) for r in routes} == {
        ("127.0.0.1:2", "127.0.0.1:3")}
    assert {(r.prefill.address if r.prefill else None) for r in
            (router.pick("m", [1], lora="x") for _ in range(4))} == {"127.0.0.1:1", "127.0.0.1:2"}
    with pytest.raises(UnknownAdapterError, match="`z`"):  # its decode has it, no prefill does
        router.pick("m", [1], lora="z")
    everything = pool.all()
    assert listed_adapters(everything) == {"x", "y", "z"}
    assert servable_adapters(everything, listed_adapters(everything)) == {"x", "y"}
    pool.add("127.0.0.1:3", "decode", "m", lora_adapters=held("x", "y", "z"), local_prefill=True)
    assert servable_adapters(pool.all(), ["z"]) == {"z"}  # a decode that prefills itself serves it alone


def test_a_decode_is_paired_only_with_prefills_holding_the_same_files() -> None:
    pool = WorkerPool()
    pool.add("127.0.0.1:1", "prefill", "m", lora_adapters={"x": "x@1"})
    pool.add("127.0.0.1:2", "prefill", "m", lora_adapters={"x": "x@2"})
    pool.add("127.0.0.1:3", "decode", "m", lora_adapters={"x": "x@2"})
    router = Router(pool, RoundRobinPolicy(), RoundRobinPolicy())
    routes = [router.pick("m", [1], lora="x") for _ in range(4)]
    assert [r.prefill.address if r.prefill else None for r in routes] == ["127.0.0.1:2"] * 4
    pool.remove("127.0.0.1:2")
    with pytest.raises(UnknownAdapterError):  # the one prefill holding `x` would refuse decode's handshake
        router.pick("m", [1], lora="x")


def test_cache_aware_matches_pages_of_the_requests_adapter_only() -> None:
    page, prompt = 4, list(range(100, 120))
    base, under_a, under_b = workers(0, 0, 0)
    keys = {"a": "a@1", "b": "b@2"}
    for worker, adapter in ((base, None), (under_a, "a"), (under_b, "b")):
        worker.lora_adapters = dict(keys)
        view = worker.kv_cache
        view.page_size, view.synced = page, True
        # each worker caches the prompt under one adapter (or the base), as its KV events name them
        view.apply(True, stored=page_hashes(prompt, page, salts=with_adapter([], keys.get(adapter or ""))))
    candidates = [base, under_a, under_b]
    policy = CacheAwarePolicy()
    assert policy.choose(candidates, prompt) is base
    assert policy.choose(candidates, prompt, "a") is under_a
    assert policy.choose(candidates, prompt, "b") is under_b
    under_a.lora_adapters = {"a": "a@3"}  # reloaded from other files: its old pages are not this adapter's
    assert policy.choose([base, under_a], prompt, "a") is base  # no match: least loaded, first


def test_cache_aware_guesses_keep_adapters_apart() -> None:
    first, second = workers(0, 0)  # publish no KV events: the policy remembers where it sent prompts
    policy = CacheAwarePolicy()
    prompt = list(range(1, 41))
    assert policy.choose([first, second], prompt, "a") is first
    second.inflight = 1  # now `first` is the least loaded: a match must outweigh it to pick second
    first.inflight = 0
    assert policy.choose([first, second], prompt, "a") is first  # its guess for `a`
    first.inflight = 1
    second.inflight = 0
    assert policy.choose([first, second], prompt) is second  # the base: `a`'s guess does not count
    first.inflight, second.inflight = 0, 1
    assert policy.choose([first, second], prompt) is second  # the base's guess now
    assert policy.choose([first, second], prompt, "b") is first  # another adapter: nothing cached
