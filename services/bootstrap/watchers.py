"""The registry's watchers: each subscriber's bounded queue of worker events, and how an event
reaches every open watch. Both registry stores (memory, etcd) use them.

Event types are the pdserve.v1 ones: JOINED and UPDATED carry a worker, LEFT carries it with a
reason, SYNCED ends a watch's snapshot.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from protos.v1 import bootstrap_pb2, common_pb2

log = logging.getLogger("pdserve.bootstrap")

JOINED = bootstrap_pb2.WORKER_EVENT_TYPE_JOINED
UPDATED = bootstrap_pb2.WORKER_EVENT_TYPE_UPDATED
LEFT = bootstrap_pb2.WORKER_EVENT_TYPE_LEFT
SYNCED = bootstrap_pb2.WORKER_EVENT_TYPE_SYNCED

ROLE_NAMES: dict[int, str] = {
    common_pb2.WORKER_ROLE_PREFILL: "prefill",
    common_pb2.WORKER_ROLE_DECODE: "decode",
    common_pb2.WORKER_ROLE_COLOCATED: "colocated",
}
# EPD's encoders (services/encoder/) are no KV worker: counted by role only once one registered.
_OTHER_ROLES: dict[int, str] = {common_pb2.WORKER_ROLE_ENCODER: "encoder"}


def role_name(role: int) -> str:
    """WORKER_ROLE_PREFILL -> "prefill" (the label used in worker ids, logs and metrics)."""
    return ROLE_NAMES.get(role) or _OTHER_ROLES.get(role, "unspecified")


class WatcherOverflow(Exception):
    """The watcher fell more than its queue bound behind and was dropped (RESOURCE_EXHAUSTED)."""


class StoreUnavailable(Exception):
    """A shared store (etcd) cannot be reached, or this process lost its view of it (UNAVAILABLE:
    clients given several registries try the next one)."""


@dataclass
class RegistryStats:
    """Counters since start, read by the metrics collector."""

    lease_expiries: int = 0
    registrations_refused: Counter[str] = field(default_factory=Counter)
    watchers_dropped: int = 0


class Watcher:
    """One subscriber's event queue: async-iterate it to receive WorkerEvents.

    Starts with a JOINED event per matching worker and one SYNCED event, then gets every change.
    Bounded: if more than `max_queued` live events wait unread, the watcher is dropped (iteration
    raises WatcherOverflow) rather than slowing the registry or the other watchers.
    Iteration ends (StopAsyncIteration) when the watcher or the registry is closed, and raises
    StoreUnavailable once the registry can no longer vouch for its events (`fail`).
    """

    def __init__(self, owner: Watchers, role: int, model: str, max_queued: int) -> None:
        self._owner = owner
        self.role = role
        self.model = model
        self.max_queued = max_queued
        self._events: deque[bootstrap_pb2.WorkerEvent] = deque()
        self._wakeup = asyncio.Event()
        self._closed = False
        self.overflowed = False
        self._failure: StoreUnavailable | None = None

    def matches(self, info: bootstrap_pb2.WorkerInfo) -> bool:
        return matches(info, self.role, self.model)

    def _push(self, event: bootstrap_pb2.WorkerEvent, *, bounded: bool = True) -> bool:
        """Queue an event; False (and the watcher marked overflowed) if it is too far behind."""
        if self._closed or self.overflowed:
            return True
        if bounded and len(self._events) >= self.max_queued:
            self.overflowed = True
            self._events.clear()
            self._wakeup.set()
            return False
        self._events.append(event)
        self._wakeup.set()
        return True

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._owner.discard(self)
            self._wakeup.set()

    def fail(self, failure: StoreUnavailable) -> None:
        """End the watch with `failure` (after nothing else: queued events may be stale)."""
        self._failure = failure
        self.close()

    def __aiter__(self) -> Watcher:
        return self

    async def __anext__(self) -> bootstrap_pb2.WorkerEvent:
        while True:
            if self.overflowed:
                raise WatcherOverflow(f"watcher fell more than {self.max_queued} events behind")
            if self._failure is not None:
                raise self._failure
            if self._events:
                return self._events.popleft()
            if self._closed:
                raise StopAsyncIteration
            self._wakeup.clear()
            await self._wakeup.wait()


class Watchers:
    """The open watches of one registry process, and how an event reaches them (both stores use it).

    Called on the event loop thread only; `len()` is read by metrics scrapes."""

    def __init__(self, stats: RegistryStats, max_queued: int) -> None:
        self.stats = stats
        self.max_queued = max_queued
        self.closed = False
        self._open: set[Watcher] = set()

    def open(self, role: int, model: str, snapshot: Iterable[bootstrap_pb2.WorkerInfo]) -> Watcher:
        """A watcher whose queue starts with JOINED per matching worker of `snapshot` and SYNCED.
        Queued at once, so no change between the snapshot and the first live event is missed."""
        watcher = Watcher(self, role, model, self.max_queued)
        for info in snapshot:
            if watcher.matches(info):
                watcher._push(bootstrap_pb2.WorkerEvent(type=JOINED, worker=info), bounded=False)
        watcher._push(bootstrap_pb2.WorkerEvent(type=SYNCED), bounded=False)
        self._open.add(watcher)
        if self.closed:
            watcher.close()
        return watcher

    def publish(self, event_type: bootstrap_pb2.WorkerEventType, info: bootstrap_pb2.WorkerInfo,
                reason: str = "") -> None:
        event = bootstrap_pb2.WorkerEvent(type=event_type, worker=info, reason=reason)
        for watcher in list(self._open):
            if watcher.matches(info) and not watcher._push(event):
                self.stats.watchers_dropped += 1
                self._open.discard(watcher)
                log.warning("dropped a watcher (role=%s model=%r): more than %d events unread",
                            role_name(watcher.role), watcher.model, watcher.max_queued)

    def discard(self, watcher: Watcher) -> None:
        self._open.discard(watcher)

    def fail(self, failure: StoreUnavailable) -> None:
        """End every open watch with `failure` (its subscribers should watch again, elsewhere)."""
        for watcher in list(self._open):
            watcher.fail(failure)

    def close(self) -> None:
        """End every watch; watches opened later end after their snapshot."""
        self.closed = True
        for watcher in list(self._open):
            watcher.close()

    def __len__(self) -> int:
        return len(self._open)


def matches(info: bootstrap_pb2.WorkerInfo, role: int, model: str) -> bool:
    """Whether a worker passes a (role, model) filter; UNSPECIFIED role and empty model match all."""
    return ((role == common_pb2.WORKER_ROLE_UNSPECIFIED or info.role == role)
            and (not model or info.model == model))
