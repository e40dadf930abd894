"""cache_aware with the store tier: pages a worker holds in its own pool count in full, pages any
worker on the same store reports in the store count `store_weight` each after the local run, so a
prefix held only in the store attracts no routing to one worker; KV event batches keep the two
media apart."""

from __future__ import annotations

import pytest

from pdserve.page_hash import page_hashes
from protos.v1 import worker_pb2
from services.gateway.kv_events import apply_batch
from services.gateway.policies import CacheAwarePolicy
from services.gateway.workers import WorkerHandle
from tests.services.gateway.test_policies import workers

PAGE = 16
STORE = "127.0.0.1:50051/pdserve/0123456789abcdef"
PROMPT = list(range(1000, 1064)) + [5] * 6  # 4 full pages of 16, then 6 tokens
HASHES = page_hashes(PROMPT, PAGE)


def on_store(worker: WorkerHandle, local: list[int] = (), in_store: list[int] = (),
             store: str = STORE) -> WorkerHandle:
    """`worker` publishing `local` pages in its own pool and `in_store` in the store `store`."""
    view = worker.kv_cache
    view.page_size, view.store, view.synced = PAGE, store, True
    view.apply(True, stored=local)
    view.apply(False, stored=in_store, in_store=True)
    return worker


def test_a_prefix_only_in_the_store_attracts_no_routing():
    a, b = workers(0, 0)
    # a wrote it; a caches more
    on_store(a, local=page_hashes(list(range(5000, 5064)), PAGE), in_store=HASHES)
    on_store(b)
    policy = CacheAwarePolicy(cache_threshold=0.4)
    # Both can fetch all 4 pages: the same score (32 tokens' worth >= 0.4 x 70), so load and then the
    # smaller cache decide (b), not the worker that happened to write it.
    assert policy.choose([a, b], PROMPT) is b
    b.inflight = 1
    assert policy.choose([a, b], PROMPT) is a


def test_a_local_prefix_beats_the_same_prefix_in_the_store():
    a, b = workers(1, 0)
    on_store(a, local=HASHES[:2])  # 2 pages here, the rest fetchable: 2 + 0.5 x 2
    on_store(b, in_store=HASHES)  # all 4 fetchable, none here: 0.5 x 4
    policy = CacheAwarePolicy(cache_threshold=0.25)
    assert policy.choose([a, b], PROMPT) is a  # though b is less loaded
    # Scored below local: the same 4 pages held locally on b win over a's 2 local ones.
    b.kv_cache.apply(False, stored=HASHES)
    assert policy.choose([a, b], PROMPT) is b


def test_store_pages_count_only_after_the_local_run_and_only_leading():
    a, b = workers(0, 0)
    on_store(a, local=HASHES[:1])
    on_store(b, in_store=[HASHES[0], HASHES[2], HASHES[3]])  # page 1 missing: the chain stops there
    policy = CacheAwarePolicy(cache_threshold=0.5)
    # a: 1 local page (16 tokens); b: 0.5 x 1 page; neither reaches half of the 70 tokens: least loaded
    # with the smaller cache, b.
    assert policy.choose([a, b], PROMPT) is b
    b.kv_cache.apply(False, stored=[HASHES[1]], in_store=True)
    # a: 1 + 0.5 x 3 = 2.5 pages (40 tokens) >= 35: a; b: 0.5 x 4 = 2 pages.
    assert policy.choose([a, b], PROMPT) is a


def test_a_store_hit_beats_computing_on_a_worker_without_the_store():
    a, c = workers(1, 0)
    on_store(a, in_store=HASHES)
    on_store(c, store="")  # no store tier: must compute it all
    # a: 0.5 x 4 pages = 32 tokens' worth, c: 0.
    assert CacheAwarePolicy(cache_threshold=0.4).choose([a, c], PROMPT) is a  # 32 >= 0.4 x 70
    assert CacheAwarePolicy(cache_threshold=0.5).choose([a, c], PROMPT) is c  # 32 < 35: least loaded


def test_another_stores_pages_give_no_credit():
    a, b = workers(1, 0)
    on_store(a, in_store=HASHES, store="10.0.0.1:50051/pdserve/aaaa")
    on_store(b, store="10.0.0.2:50051/pdserve/aaaa")
    policy = CacheAwarePolicy(cache_threshold=0.4)
    assert policy.choose([a, b], PROMPT) is a  # a's own store holds it; b's does not
    on_store(a, in_store=HASHES, store=b.kv_cache.store)
    a.kv_cache.apply(False, removed=HASHES, in_store=True)
    on_store(b, in_store=HASHES, store="10.0.0.3:50051/pdserve/aaaa")
    assert policy.choose([a, b], PROMPT) is b


def test_store_weight_must_keep_a_store_hit_below_a_local_one():
    for weight in (1.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="store_weight"):
            CacheAwarePolicy(store_weight=weight)
    a, b = workers(0, 0)
    on_store(a, in_store=HASHES)
    on_store(b, local=page_hashes(list(range(5000, 5064)), PAGE))
    # store_weight 0: the store is ignored; nothing cached for this prompt: least loaded, smaller cache.
    assert CacheAwarePolicy(store_weight=0.0).choose([a, b], PROMPT) is a


def test_kv_event_batches_keep_the_media_apart():
    (a,) = workers(0)
    stored, removed = worker_pb2.KV_EVENT_KIND_STORED, worker_pb2.KV_EVENT_KIND_REMOVED
    device, store = worker_pb2.KV_MEDIUM_DEVICE, worker_pb2.KV_MEDIUM_STORE
    a.kv_cache.store_hashes = {99}  # stale: a snapshot replaces both media
    apply_batch(a, worker_pb2.KvEventBatch(snapshot=True, page_size=PAGE, store=STORE, events=[
        worker_pb2.KvEvent(kind=stored, medium=device, page_hashes=[1, 2]),
        worker_pb2.KvEvent(kind=stored, medium=store, page_hashes=[2, 3])]))
    view = a.kv_cache
    assert view.synced and view.store == STORE and view.hashes == {1, 2} and view.store_hashes == {2, 3}
    apply_batch(a, worker_pb2.KvEventBatch(page_size=PAGE, store=STORE, events=[
        worker_pb2.KvEvent(kind=removed, medium=device, page_hashes=[2]),
        worker_pb2.KvEvent(kind=stored, page_hashes=[4]),  # no medium (an older worker): its own pool
        worker_pb2.KvEvent(kind=removed, medium=store, page_hashes=[3])]))
    assert view.hashes == {1, 4} and view.store_hashes == {2}
    a.kv_cache.forget()
    assert not view.synced and view.hashes == set() and view.store_hashes == set()
