"""The leak detector every worker runs: pages in use must return to idle when nothing is live.

Every `interval_s` it compares who holds KV pages with which rooms are live:
- a live room is one the worker is working on: a room in its room table (services/worker/rooms.py:
  prefill rooms in handshake/waiting/inflight, decode and colocated requests, quarantined rooms);
- a reservation or hold (PageManager) whose room is not live is a leak, and so are pages in use
  beyond the idle value while no room is live at all (pages nobody can name).
Pages in use are those with a reference count (libkv.allocator): a request's, a reservation's or a
hold's. The prefix cache's idle pages (cached, used by nobody, evictable) are not in use: they
count as free, as they can be handed out at once, so a worker whose cache holds many pages is idle
at 0 pages in use like one without a cache. A leaked reference on a cached page still shows: the
page stays in use.
A leak seen twice in a row (a room finishing between the two reads is not one) is logged as an
error naming the rooms and their pages, and counted in `pdserve:kv_leak_detections_total`, once
per leak. The e2e tests fail when that counter is not zero. It never frees anything: a leak is a
bug to find, not to paper over.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from engine.api import EngineAPI

log = logging.getLogger("pdserve.leak")


@dataclass(frozen=True)
class Leak:
    rooms: tuple[tuple[str, int], ...]  # (room, pages) of reservations/holds no live room owns
    unowned_pages: int  # pages in use beyond the idle value while no room was live

    def describe(self) -> str:
        parts = [f"room {room} holds {pages} page(s)" for room, pages in self.rooms[:16]]
        if len(self.rooms) > 16:
            parts.append(f"and {len(self.rooms) - 16} more rooms")
        if self.unowned_pages:
            parts.append(f"{self.unowned_pages} page(s) in use with no live room")
        return "; ".join(parts)


class LeakDetector:
    """Checks one worker's pages against its live rooms (see the module docstring): `live_rooms`
    is its room table's `live`."""

    def __init__(self, engine: EngineAPI, live_rooms: Callable[[], set[str]], on_leak: Callable[[Leak], None],
                 *, interval_s: float = 1.0, idle_pages: Callable[[], int] = lambda: 0) -> None:
        self.engine = engine
        self.live_rooms = live_rooms
        self.on_leak = on_leak
        self.interval_s = interval_s
        self.idle_pages = idle_pages
        self._previous: Leak | None = None
        self._reported: Leak | None = None

    def observe(self) -> Leak | None:
        """One look: the leak seen now, if any (not yet confirmed)."""
        live = self.live_rooms()
        owners = self.engine.pages.pages_by_room()
        stale = tuple(sorted((room, pages) for room, pages in owners.items() if room not in live))
        unowned = 0
        if not live:
            unowned = self.engine.pages.used_pages - sum(owners.values()) - self.idle_pages()
        if not stale and unowned <= 0:
            return None
        return Leak(stale, max(unowned, 0))

    def check(self) -> Leak | None:
        """Observe; report a leak seen on two consecutive checks, once. Returns the confirmed leak."""
        leak = self.observe()
        confirmed = leak if leak is not None and leak == self._previous else None
        self._previous = leak
        if confirmed is not None and confirmed != self._reported:
            self._reported = confirmed
            log.error("KV page leak: %s", confirmed.describe())
            self.on_leak(confirmed)
        if leak is None:
            self._reported = None
        return confirmed

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.check()
            except Exception:  # the detector must never take the worker down
                log.exception("leak check failed")
