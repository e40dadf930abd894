"""How long the gateway's event loop runs without a turn for a timer: the stalls every stream it
relays feels at once.

A timer task wakes every WATCH_INTERVAL_S and takes the CPU time the loop's thread spent since its
last wake (time.thread_time, so a machine busy with other processes barely changes it, where the
wall-clock lateness of the wake would count their time too). A stretch longer than the interval is
work that ran between two of the loop's turns at the timer (one long callback, or one iteration's
worth of many), and is observed into `gateway_event_loop_busy_seconds`; an idle or lightly used loop
observes nothing. `pdserve bench big-bodies` reads it to count the stalls each big body costs.

Who calls: the gateway's main (`_serve`) runs `watch_event_loop` for the life of the server.
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import Histogram

WATCH_INTERVAL_S = 0.005


async def watch_event_loop(busy: Histogram, interval_s: float = WATCH_INTERVAL_S) -> None:
    """Observe into `busy` each stretch of the loop thread's CPU time longer than `interval_s`
    between two wakes of a timer; runs until cancelled."""
    last = time.thread_time()
    while True:
        await asyncio.sleep(interval_s)
        now = time.thread_time()
        if now - last > interval_s:
            busy.observe(now - last)
        last = now
