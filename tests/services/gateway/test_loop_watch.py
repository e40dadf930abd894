"""The event loop watch (services/gateway/loop_watch.py) observes a stretch of CPU time on the loop
longer than its interval, and nothing while the loop only waits."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, Histogram

from services.gateway.loop_watch import watch_event_loop


def _busy(seconds: float) -> None:
    """Hold the loop's thread on the CPU (sleeping would not count: the watch reads CPU time)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


async def test_a_long_callback_is_observed_and_waiting_is_not():
    busy = Histogram("loop_busy_seconds", "", buckets=(0.01, 0.02, 0.05, 1.0), registry=CollectorRegistry())
    watch = asyncio.create_task(watch_event_loop(busy, interval_s=0.005))
    try:
        await asyncio.sleep(0.1)  # idle: the loop only waits for the timer
        idle = busy.collect()[0]
        assert [s.value for s in idle.samples if s.name.endswith("_count")] == [0]
        _busy(0.03)
        await asyncio.sleep(0.02)
    finally:
        watch.cancel()
    samples = {(s.name, s.labels.get("le")): s.value for s in busy.collect()[0].samples}
    assert samples["loop_busy_seconds_count", None] == 1
    buckets = samples["loop_busy_seconds_bucket", "0.02"], samples["loop_busy_seconds_bucket", "0.05"]
    assert buckets == (0, 1)
