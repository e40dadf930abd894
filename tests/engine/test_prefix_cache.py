"""The prefix cache in the scheduler and page manager, exact and without a model (the engine loop
is simulated as in test_scheduler.py): hits, sharing, LRU eviction order, refcounts back to idle."""

from __future__ import annotations

from engine.page_manager import PageManager, PrefixCache
from engine.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig
from libkv.allocator import PageAllocator
from pdserve.page_hash import ROOT_HASH, page_hash, page_hashes
from tests.engine.test_scheduler import run_step, spans


def make(num_pages=16, page_size=4, chunk=64, max_running=8) -> Scheduler:
    return Scheduler(SchedulerConfig(max_running_requests=max_running, chunked_prefill_size=chunk,
                                     max_seq_len=1000), PageManager(num_pages, page_size, prefix_cache=True))


def request(room: str, tokens: list[int]) -> Request:
    return Request(room=room, token_ids=list(tokens), num_prompt=len(tokens))


def finish(scheduler: Scheduler, room: str) -> None:
    scheduler.finish(scheduler.requests[room], "stop")


def idle(scheduler: Scheduler) -> bool:
    allocator = scheduler.pages.allocator
    return allocator.used_pages == 0 and all(allocator.ref_count(p) == 0 for p in range(allocator.num_pages))


PROMPT = list(range(100, 110))  # 10 tokens: 2 full pages of 4 and a partial one


def test_page_hashes_are_chained():
    hashes = page_hashes(list(range(10)), 4)
    assert len(hashes) == 2  # the partial page has none
    assert hashes[0] == page_hash(ROOT_HASH, [0, 1, 2, 3])
    assert hashes[1] == page_hash(hashes[0], [4, 5, 6, 7])
    assert page_hashes(list(range(10)), 4, hashes[:1]) == hashes
    assert page_hashes([9, 1, 2, 3, 4, 5, 6, 7], 4)[1] != hashes[1]  # same page, other parent


def test_second_request_skips_the_cached_pages_and_shares_them():
    scheduler = make()
    scheduler.add(request("a", PROMPT))
    assert spans(run_step(scheduler)) == [("a", 0, 10, True)]
    a = scheduler.requests["a"]
    assert a.page_ids == [0, 1, 2] and scheduler.pages.cache.num_pages == 2  # cached as soon as computed
    scheduler.add(request("b", PROMPT[:8] + [7, 7, 7]))
    batch = run_step(scheduler)
    assert spans(batch) == [("a", 10, 11, True), ("b", 8, 11, True)]
    b = scheduler.requests["b"]
    assert b.page_ids[:2] == [0, 1] and b.page_ids[2] not in a.page_ids  # shared read-only
    assert [scheduler.pages.allocator.ref_count(p) for p in (0, 1)] == [2, 2]
    stats = scheduler.pages.cache.stats
    assert (stats.query_tokens, stats.hit_tokens) == (21, 8)
    finish(scheduler, "a")
    finish(scheduler, "b")
    assert idle(scheduler) and scheduler.pages.free_pages == 16


def test_a_fully_cached_prompt_recomputes_its_last_page():
    scheduler = make()
    prompt = PROMPT[:8]  # exactly two pages
    scheduler.add(request("a", prompt))
    run_step(scheduler)
    finish(scheduler, "a")
    scheduler.add(request("b", prompt))
    assert spans(run_step(scheduler)) == [("b", 4, 8, True)]  # page 0 cached, page 1 recomputed
    scheduler.add(request("c", prompt + [5]))
    assert spans(run_step(scheduler))[-1] == ("c", 8, 9, True)  # one token left to compute
    finish(scheduler, "b")
    finish(scheduler, "c")
    assert idle(scheduler)


def test_generated_tokens_are_cached_when_a_request_leaves():
    scheduler = make()
    scheduler.add(request("a", PROMPT))
    for _ in range(4):
        run_step(scheduler)  # prompt, then decodes: tokens 10..13 are 7s
    a = scheduler.requests["a"]
    assert a.num_computed == 13 and scheduler.pages.cache.num_pages == 2
    finish(scheduler, "a")
    assert scheduler.pages.cache.num_pages == 3  # the page of tokens 8-11 is full and computed
    scheduler.add(request("turn2", a.token_ids + [1, 2, 3]))
    assert spans(run_step(scheduler)) == [("turn2", 12, 17, True)]


def test_idle_pages_are_evicted_lru_leaves_first_never_in_use():
    scheduler = make(num_pages=6)
    cache, allocator = scheduler.pages.cache, scheduler.pages.allocator
    removed = []
    cache.listeners.append(lambda kind, hashes: removed.extend(hashes) if kind == "removed" else None)
    scheduler.add(request("a", PROMPT[:9]))  # pages 0, 1 (full: cached) and 2
    run_step(scheduler)
    finish(scheduler, "a")
    assert allocator.idle_order() == [1, 0]  # released last page first: the leaf goes first
    scheduler.add(request("b", [1] * 9))  # free pages first: 2, 3, 4
    run_step(scheduler)
    assert scheduler.requests["b"].page_ids == [2, 3, 4]
    finish(scheduler, "b")
    assert allocator.idle_order() == [1, 0, 3, 2]  # page 4 (partial) went back to the free heap
    scheduler.add(request("d", [5] * 19))  # 5 pages: free 4, 5, then evicts 1, 0, 3
    run_step(scheduler)
    assert scheduler.requests["d"].page_ids == [4, 5, 1, 0, 3]
    hashes_a, hashes_b = page_hashes(PROMPT[:9], 4), page_hashes([1] * 9, 4)
    assert removed == [hashes_a[1], hashes_a[0], hashes_b[1]] and cache.stats.evicted_pages == 3
    assert cache.match(PROMPT, 2) == [] and cache.match([1] * 9, 2) == [2]
    # Pages in use are never evicted: a newcomer needing two pages waits (only page 2 is idle).
    scheduler.add(request("e", [6] * 8))
    run_step(scheduler)
    assert scheduler.requests["e"].status is RequestStatus.WAITING and allocator.idle_order() == [2]
    assert all(allocator.ref_count(p) == 1 for p in scheduler.requests["d"].page_ids)
    finish(scheduler, "d")
    run_step(scheduler)
    assert scheduler.requests["e"].status is RequestStatus.RUNNING
    finish(scheduler, "e")
    assert idle(scheduler)


def test_exact_eviction_order_in_the_cache():
    allocator = PageAllocator(4)
    cache = PrefixCache(allocator, page_size=2)
    events = []
    cache.listeners.append(lambda kind, hashes: events.append((kind, len(hashes))))
    tokens = [1, 2, 3, 4, 5, 6]
    pages = allocator.allocate(3)
    hashes = page_hashes(tokens, 2)
    cache.insert(tokens, pages, hashes)
    assert events == [("stored", 3)]
    allocator.release([pages[2], pages[1], pages[0]])  # as PageManager.free: last page first
    assert allocator.allocate(2) == [3, pages[2]]
    assert events[-1] == ("removed", 1) and cache.num_pages == 2
    assert cache.match(tokens, 3) == pages[:2]  # the surviving prefix still matches
    assert cache.match([1, 2, 9, 9], 2) == pages[:1]
    assert cache.stats.evicted_pages == 1


def test_a_hash_collision_is_a_miss_not_someone_elses_kv():
    allocator = PageAllocator(4)
    cache = PrefixCache(allocator, page_size=2)
    pages = allocator.allocate(1)
    cache.insert([1, 2], pages, [42])  # pretend [1, 2] hashed to 42
    assert cache.match([1, 2], 1, hashes=[42]) == pages
    assert cache.match([8, 9], 1, hashes=[42]) == []  # same hash, other tokens


def test_retraction_with_the_cache_resumes_from_cached_pages_and_ends_idle():
    scheduler = make(num_pages=6, page_size=4)
    scheduler.add(request("a", list(range(8))))
    scheduler.add(request("b", list(range(50, 53))))
    run_step(scheduler)
    while scheduler.num_retractions == 0:
        run_step(scheduler)
    b = scheduler.requests["b"]
    assert b.status is RequestStatus.WAITING and b.page_ids == []
    finish(scheduler, "a")
    batch = run_step(scheduler)
    # b's two full pages were cached when it was retracted: it recomputes only its last token.
    assert b.token_ids[:4] == [50, 51, 52, 7] and spans(batch) == [("b", 8, 9, True)]
    finish(scheduler, "b")
    assert idle(scheduler)


def test_reserve_prompt_reuses_cached_pages_for_decode():
    pages = PageManager(num_pages=8, page_size=4, prefix_cache=True)
    tokens = list(range(12))
    owned = pages.allocator.allocate(3)
    pages.cache_pages(tokens, owned, page_hashes(tokens, 4))
    pages.free(owned)
    reservation = pages.reserve_prompt("r", tokens + [99])
    assert reservation.cached_pages == 3 and len(reservation.pages) == 4
    assert reservation.tail == reservation.pages[3:]
    aligned = pages.reserve_prompt("s", tokens)  # every full page may come from the cache on decode
    assert aligned.cached_pages == 3 and aligned.tail == []
    assert pages.release("r") and pages.release("s")
    assert pages.used_pages == 0 and pages.allocator.idle_pages == 3
