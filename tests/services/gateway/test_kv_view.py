"""The gateway's view of a worker's cache stays within its cap (services/gateway/kv_view.py), and KV
event batches carry the worker's stamp of their oldest event (services/worker/kv_events.py)."""

from __future__ import annotations

import asyncio
import random
import time

from services.gateway.kv_view import KvCacheView, PageSet, leading_run, leading_runs
from services.worker.kv_events import _Subscription


def test_page_set_drops_the_earliest_stored_past_its_cap():
    pages = PageSet([1, 2, 3, 4], max_pages=3)
    assert list(pages) == [2, 3, 4] and pages.dropped == 1 and 1 not in pages
    pages.remove([3, 99])
    assert list(pages) == [2, 4]
    pages.store([2])  # stored again: keeps its place
    pages.store([5, 6])
    assert list(pages) == [4, 5, 6] and pages.dropped == 2 and len(pages) == 3
    assert pages == {4, 5, 6} and pages != {4, 5}


def test_view_is_bounded_per_medium_and_a_snapshot_starts_over():
    view = KvCacheView(max_pages=2)
    view.apply(True, stored=list(range(10)))
    view.apply(False, stored=[20, 21, 22], in_store=True)
    assert view.hashes == {8, 9} and view.store_hashes == {21, 22}
    assert view.cached_pages([8, 9, 1]) == 2 and view.cached_pages([7, 8]) == 0
    view.apply(True, stored=[1])
    assert view.hashes == {1} and len(view.store_hashes) == 0 and view.hashes.max_pages == 2
    view.forget()
    assert len(view.hashes) == 0 and view.hashes.max_pages == 2


async def test_a_batch_is_stamped_with_its_oldest_event():
    subscription = _Subscription(asyncio.get_running_loop(), max_pending=100)
    before = time.time()
    subscription.add("stored", 1, [1, 2])
    after_first = time.time()
    subscription.add("removed", 1, [1])
    events, oldest = subscription.take()
    assert [kind for kind, _, _ in events] == ["stored", "removed"]
    assert before <= oldest <= after_first
    subscription.add("stored", 1, [3])  # the next batch starts its own clock
    assert subscription.take()[1] >= after_first


def test_leading_runs_count_as_leading_run_and_read_no_page_past_the_longest_run():
    rng = random.Random(3)
    for _ in range(200):
        prompt = [rng.getrandbits(64) for _ in range(rng.randrange(0, 30))]
        held = [set(h for h in prompt[:rng.randrange(0, len(prompt) + 1)] if rng.random() < 0.9)
                | {rng.getrandbits(64)} for _ in range(rng.randrange(0, 6))]
        taken: list[int] = []

        def lazily(taken=taken, prompt=prompt):
            for digest in prompt:
                taken.append(digest)
                yield digest

        runs = leading_runs(lazily(), held)
        assert runs == [leading_run(prompt, [only]) for only in held]
        assert len(taken) == min(len(prompt), max(runs, default=0) + 1) or not held
        assert leading_runs(prompt, held) == runs  # a list works too
