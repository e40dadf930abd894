"""Routing policies pick exactly what they promise, and the prefix tree evicts least recently used prompts."""

from __future__ import annotations

import pytest

from services.gateway.policies import (
    CacheAwarePolicy,
    PowerOfTwoPolicy,
    RandomPolicy,
    RoundRobinPolicy,
    make_policy,
)
from services.gateway.policies.prefix_tree import PrefixTree
from services.gateway.workers import WorkerHandle


def workers(*loads: int, role: str = "decode") -> list[WorkerHandle]:
    return [WorkerHandle(address=f"127.0.0.1:{9000 + i}", role=role, model="m", inflight=load)
            for i, load in enumerate(loads)]


def test_round_robin_cycles_in_order() -> None:
    a, b, c = workers(0, 0, 0)
    policy = RoundRobinPolicy()
    assert [policy.choose([a, b, c], [1]).address for _ in range(7)] == [
        a.address, b.address, c.address, a.address, b.address, c.address, a.address]


def test_round_robin_ignores_load() -> None:
    busy, idle = workers(100, 0)
    policy = RoundRobinPolicy()
    assert [policy.choose([busy, idle], []) for _ in range(4)] == [busy, idle, busy, idle]


def test_random_is_reproducible_with_a_seed_and_covers_all() -> None:
    pool = workers(0, 0, 0)
    first, second = RandomPolicy(seed=7), RandomPolicy(seed=7)
    picks_a = [first.choose(pool, []).address for _ in range(50)]
    picks_b = [second.choose(pool, []).address for _ in range(50)]
    assert picks_a == picks_b
    assert set(picks_a) == {w.address for w in pool}


def test_power_of_two_picks_the_less_loaded_of_two() -> None:
    light, heavy = workers(1, 9)
    policy = PowerOfTwoPolicy(seed=0)
    # with two candidates both are always sampled: the less loaded wins every time
    assert all(policy.choose([heavy, light], []) is light for _ in range(20))


def test_power_of_two_never_picks_the_most_loaded_of_three() -> None:
    pool = workers(5, 0, 9)
    policy = PowerOfTwoPolicy(seed=1)
    picks = [policy.choose(pool, []) for _ in range(200)]
    assert pool[2] not in picks  # the most loaded loses whichever pair is sampled
    assert pool[1] in picks and pool[0] in picks  # (5, 9) pairs pick the 5


def test_power_of_two_breaks_inflight_ties_with_reported_load() -> None:
    from services.gateway.workers import ReportedLoad

    a, b = workers(2, 2)
    b.reported = ReportedLoad(queued=0, running=1)
    a.reported = ReportedLoad(queued=5, running=3)
    assert all(PowerOfTwoPolicy(seed=s).choose([a, b], []) is b for s in range(10))


def test_cache_aware_prefers_the_longest_cached_prefix() -> None:
    a, b = workers(0, 0)
    policy = CacheAwarePolicy(cache_threshold=0.5)
    system = list(range(100, 140))
    assert policy.choose([a, b], system + [1, 2]) is a  # nothing cached: least loaded, first
    b.inflight = 0
    a.inflight = 1  # a is busier now, still within balance thresholds
    assert policy.choose([a, b], system + [3, 4]) is a  # 40 of 42 tokens cached on a
    assert policy.choose([a, b], [7, 8, 9]) is b  # unrelated prompt: least loaded


def test_cache_aware_follows_each_workers_prefixes() -> None:
    a, b = workers(0, 0)
    policy = CacheAwarePolicy(cache_threshold=0.5)
    policy.tree.insert([1, 2, 3, 4, 5, 6], a.key)
    policy.tree.insert([9, 8, 7, 6, 5, 4], b.key)
    assert policy.choose([a, b], [9, 8, 7, 6, 0, 0]) is b
    assert policy.choose([a, b], [1, 2, 3, 4, 0]) is a
    # below the threshold (2 of 6 cached) the prefix does not count: least loaded, then smaller tree
    a.inflight = 3
    assert policy.choose([a, b], [1, 2, 0, 0, 0, 0]) is b


def test_cache_aware_falls_back_to_least_loaded_under_imbalance() -> None:
    a, b = workers(0, 0)
    policy = CacheAwarePolicy(cache_threshold=0.5, balance_abs_threshold=4, balance_rel_threshold=1.5)
    prompt, other = list(range(50)), list(range(100, 150))
    policy.tree.insert(prompt, a.key)
    policy.tree.insert(other, a.key)
    a.inflight, b.inflight = 4, 0
    assert policy.choose([a, b], prompt) is a  # spread 4 is not above the threshold: cache wins
    a.inflight = 5
    assert policy.choose([a, b], prompt) is b  # spread 5 > 4 and 5 > 1.5 x 0: load wins
    a.inflight, b.inflight = 12, 8
    assert policy.choose([a, b], other) is a  # spread 4 again: cache wins (only a has `other`)
    a.inflight, b.inflight = 40, 30
    assert policy.choose([a, b], other) is a  # spread 10 > 4 but 40 < 1.5 x 30: not imbalanced


def test_cache_aware_forgets_a_removed_worker() -> None:
    a, b = workers(0, 0)
    policy = CacheAwarePolicy()
    policy.tree.insert([1, 2, 3], a.key)
    policy.forget(a)
    assert policy.tree.match([1, 2, 3]) == {}
    assert policy.tree.size(a.key) == 0


def test_prefix_tree_match_lengths() -> None:
    tree = PrefixTree()
    tree.insert([1, 2, 3, 4], "a")
    tree.insert([1, 2, 9], "b")
    tree.insert([1, 2, 3], "b")
    assert tree.match([1, 2, 3, 4, 5]) == {"a": 4, "b": 3}
    assert tree.match([1, 2, 9, 9]) == {"a": 2, "b": 3}
    assert tree.match([5]) == {}
    assert tree.size("a") == 4 and tree.size("b") == 4  # b: 1, 2, 3, 9


def test_prefix_tree_evicts_least_recently_routed_prompts_first() -> None:
    tree = PrefixTree(max_tokens_per_worker=8)
    tree.insert([1, 2, 3, 4], "w")       # oldest
    tree.insert([1, 2, 5, 6], "w")       # shares [1, 2]: 6 nodes
    tree.insert([1, 2, 3, 4], "w")       # touched again: now the newest
    tree.insert([7, 8, 9], "w")          # 9 nodes > 8: evict the least recent, [1, 2, 5, 6] from its end
    assert tree.size("w") == 7
    assert tree.match([1, 2, 5, 6]) == {"w": 2}  # the shared prefix stays (still on [1, 2, 3, 4])
    assert tree.match([1, 2, 3, 4]) == {"w": 4}
    assert tree.match([7, 8, 9]) == {"w": 3}


def test_prefix_tree_eviction_is_per_worker() -> None:
    tree = PrefixTree(max_tokens_per_worker=3)
    tree.insert([1, 2, 3], "a")
    tree.insert([1, 2, 3], "b")
    tree.insert([4, 5], "b")  # b over budget: drops [1, 2, 3]; a keeps it
    assert tree.match([1, 2, 3]) == {"a": 3}
    assert tree.match([4, 5]) == {"b": 2}
    assert tree.size("b") == 2


def test_make_policy_by_name() -> None:
    assert isinstance(make_policy("round_robin"), RoundRobinPolicy)
    assert isinstance(make_policy("random"), RandomPolicy)
    assert isinstance(make_policy("power_of_two"), PowerOfTwoPolicy)
    assert isinstance(make_policy("cache_aware"), CacheAwarePolicy)
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        make_policy("fastest")


def synced(worker: WorkerHandle, page_size: int, *prompts: list[int]) -> WorkerHandle:
    """`worker` publishing a prefix cache that holds every full page of `prompts`."""
    from pdserve.page_hash import page_hashes

    worker.kv_cache.page_size = page_size
    worker.kv_cache.apply(True, stored=[h for p in prompts for h in page_hashes(p, page_size)])
    worker.kv_cache.synced = True
    return worker


def test_cache_aware_routes_on_published_cache_state() -> None:
    a, b = workers(0, 0)
    policy = CacheAwarePolicy(cache_threshold=0.5)
    system = list(range(100, 164))  # 4 pages of 16
    synced(a, 16, [7] * 64)
    synced(b, 16, system)
    # b holds the prompt's 4 leading pages (64 of 70 tokens): b, though a is first and as loaded.
    assert policy.choose([a, b], system + [1] * 6) is b
    # The chain stops at the first page b lacks: a prompt differing in page 0 matches nothing there.
    assert policy.choose([a, b], [1] + system[1:]) is a
    # Real state wins over the guess: routing to b did not make b "cache" this prompt.
    other = list(range(500, 564))
    assert policy.choose([a, b], other) is a
    a.inflight = 1
    assert policy.choose([a, b], other) is b  # nothing cached anywhere: least loaded
    # Evictions count: once b's pages are removed, b no longer attracts the system prompt.
    from pdserve.page_hash import page_hashes

    b.kv_cache.apply(False, removed=page_hashes(system, 16)[:1])
    a.inflight, b.inflight = 0, 1
    assert policy.choose([a, b], system + [1] * 6) is a


def test_cache_aware_hashes_with_each_workers_page_size() -> None:
    a, b = workers(1, 0)
    policy = CacheAwarePolicy(cache_threshold=0.5)
    prompt = list(range(200, 264))
    synced(a, 32, prompt)  # a caches the prompt, in pages of 32
    synced(b, 16, prompt[:16])
    assert policy.choose([a, b], prompt) is a  # 64 tokens on a beat 16 on b and b's lighter load


def test_cache_aware_over_a_fleet_picks_the_longest_run_as_counted_page_by_page() -> None:
    """64 workers of two page sizes, each holding a random part of the prompt's pages (holes
    included): the pick is the worker whose leading run, counted on every page of its own hashes,
    is longest (ties to the least loaded), request after request (the page-hash memo warm)."""
    import random

    from pdserve.page_hash import page_hashes

    rng = random.Random(9)
    fleet = workers(*[rng.randrange(0, 3) for _ in range(64)])
    policy = CacheAwarePolicy(cache_threshold=0.0, balance_abs_threshold=1000)
    documents = [[rng.randrange(1, 1000) for _ in range(256)] for _ in range(4)]
    for worker in fleet:
        size = rng.choice([16, 32])
        worker.kv_cache.page_size = size
        document = rng.choice(documents)
        pages = page_hashes(document, size)[:rng.randrange(0, 256 // size + 1)]
        worker.kv_cache.apply(True, stored=[h for h in pages if rng.random() < 0.97])
        worker.kv_cache.synced = True
    for _ in range(20):
        prompt = rng.choice(documents) + [rng.randrange(1, 1000) for _ in range(40)]
        cached = {w.key: w.kv_cache.cached_pages(page_hashes(prompt, w.kv_cache.page_size))
                  * w.kv_cache.page_size for w in fleet}
        best = max(cached.values())
        expected = min((w for w in fleet if cached[w.key] == best),
                       key=lambda w: (w.load, len(w.kv_cache.hashes) * w.kv_cache.page_size))
        assert best > 0 and policy.choose(fleet, prompt) is expected


def test_kv_event_batches_apply_snapshot_then_deltas() -> None:
    from protos.v1 import worker_pb2
    from services.gateway.kv_events import apply_batch

    (a,) = workers(0)
    a.page_size = 16
    a.kv_cache.hashes = {99}  # stale: a snapshot replaces it
    stored, removed = worker_pb2.KV_EVENT_KIND_STORED, worker_pb2.KV_EVENT_KIND_REMOVED
    apply_batch(a, worker_pb2.KvEventBatch(snapshot=True, page_size=16, events=[
        worker_pb2.KvEvent(kind=stored, page_hashes=[1, 2, 3])]))
    assert a.kv_cache.synced and a.kv_cache.hashes == {1, 2, 3} and a.kv_cache.page_size == 16
    apply_batch(a, worker_pb2.KvEventBatch(events=[
        worker_pb2.KvEvent(kind=removed, page_hashes=[2]),
        worker_pb2.KvEvent(kind=stored, page_hashes=[2, 4]),
        worker_pb2.KvEvent(kind=removed, page_hashes=[1])]))
    assert a.kv_cache.hashes == {2, 3, 4}  # in order: 2 removed, then stored again
    a.kv_cache.forget()
    assert not a.kv_cache.synced and a.kv_cache.hashes == set()
