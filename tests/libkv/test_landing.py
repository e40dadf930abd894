"""wait_landed: a page counts as landed once it hashes to what the sender computed, and only then."""

from __future__ import annotations

import threading

from libkv.landing import wait_landed
from libkv.layout import KVLayout
from libkv.pool import KVPool


def _pool() -> KVPool:
    return KVPool(KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float32"), 8)


def _fill(pool: KVPool, page: int, value: float) -> None:
    pool.buffer[page].fill_(value)


async def test_waits_for_bytes_that_land_late():
    sender, receiver = _pool(), _pool()
    for page in (1, 2, 3):
        _fill(sender, page, float(page))
    sent = sender.page_checksums([1, 2, 3])
    _fill(receiver, 1, 1.0)  # one page already here, two still on their way
    timer = threading.Timer(0.2, lambda: [_fill(receiver, p, float(p)) for p in (2, 3)])
    timer.start()
    try:
        assert await wait_landed(receiver, [1, 2, 3], sent, timeout_s=10) == []
    finally:
        timer.cancel()
    assert receiver.page_checksums([1, 2, 3]) == sent


async def test_reports_pages_that_never_match():
    sender, receiver = _pool(), _pool()
    for page in (4, 5):
        _fill(sender, page, 7.0)
    _fill(receiver, 4, 7.0)
    _fill(receiver, 5, 6.0)  # damaged, or a write cut short: it will not change any more
    assert await wait_landed(receiver, [4, 5], sender.page_checksums([4, 5]), timeout_s=0.3) == [5]
