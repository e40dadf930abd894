"""Which PD queue each request (room) is in, for logs, metrics and registry heartbeats.

Queue names are docs/architecture.md's: prefill `bootstrap -> waiting -> inflight`; decode
`prealloc -> transfer -> waiting -> running`. The engine's own scheduler knows `waiting`/`running`
of the requests it holds; this tracker covers the service-side stages before a request reaches it.
"""

from __future__ import annotations

import threading
from collections import Counter

PREFILL_QUEUES = ("bootstrap", "waiting", "inflight")
DECODE_QUEUES = ("prealloc", "transfer", "waiting", "running")


class RoomQueues:
    """room -> queue name, with counts per queue. Thread-safe (the engine thread reports too)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self._where: dict[str, str] = {}
        self._lock = threading.Lock()

    def move(self, room: str, queue: str) -> None:
        if queue not in self.names:
            raise ValueError(f"unknown queue {queue!r}; expected one of {self.names}")
        with self._lock:
            self._where[room] = queue

    def leave(self, room: str) -> None:
        with self._lock:
            self._where.pop(room, None)

    def where(self, room: str) -> str | None:
        with self._lock:
            return self._where.get(room)

    def counts(self) -> dict[str, int]:
        with self._lock:
            counted = Counter(self._where.values())
        return {name: counted.get(name, 0) for name in self.names}
