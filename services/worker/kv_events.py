"""pdserve.v1.KvEvents on every worker: the prefix cache's stored/removed page hashes, streamed.

Each event names its medium (tier): KV_MEDIUM_DEVICE for the worker's own KV pool (the prefix
cache: a local hit), KV_MEDIUM_STORE for pages the store tier of --enable-hierarchical-cache knows
are in the cluster-wide store (written through or fetched by this worker; libkv/store/tier.py's
watch), which any worker on the same store can fetch. A page is often in both. The batches name
the store (`store`: its master and key namespace), so the gateway can tell which workers share it.

The engine's PageManager calls a subscription's listener on every cache change (from the engine
thread or a service thread, under its lock), so the listener only appends to a buffer and wakes
the subscriber's event loop when the buffer was empty; the stream sends what piled up as one
batch, stamped with the wall clock of its oldest event (`oldest_event_unix_s`: the subscriber's
lag). At most one batch goes out per `min_batch_interval_s` (MIN_BATCH_INTERVAL_S): at GPU rates a
worker's cache changes every step (about 20 ms), and a subscriber pays a fixed cost per message (the
gRPC read, the protobuf) that, over 64 workers, was most of a gateway's ingest; the events of the
interval go out as one batch instead, for at most that much more lag. A snapshot taken with the
registration (PageManager.watch_cache) goes first, so the subscriber's view is exact from then on.
A subscriber more than `max_pending` hashes behind is dropped with RESOURCE_EXHAUSTED: it
resubscribes and gets a fresh snapshot, instead of the worker buffering without bound.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque

import grpc

from engine.api import EngineAPI
from protos.v1 import worker_pb2, worker_pb2_grpc

_KINDS = {"stored": worker_pb2.KV_EVENT_KIND_STORED, "removed": worker_pb2.KV_EVENT_KIND_REMOVED}
DEVICE, STORE = worker_pb2.KV_MEDIUM_DEVICE, worker_pb2.KV_MEDIUM_STORE
MIN_BATCH_INTERVAL_S = 0.05  # one batch per 50 ms at most: 1/20 of the gateway's 1 s lag budget


class _Subscription:
    def __init__(self, loop: asyncio.AbstractEventLoop, max_pending: int) -> None:
        self._loop = loop
        self._max_pending = max_pending
        self._lock = threading.Lock()
        # (kind, medium, page hashes)
        self._events: deque[tuple[str, worker_pb2.KvMedium, list[int]]] = deque()
        self._pending = 0
        self.oldest_at = 0.0  # wall clock of the oldest event not sent yet (the batch's lag starts there)
        self.overflowed = False
        self.closed = False
        self.ready = asyncio.Event()

    def __call__(self, kind: str, hashes: list[int]) -> None:  # the prefix cache's listener
        self.add(kind, DEVICE, hashes)

    def store_listener(self, kind: str, hashes: list[int]) -> None:  # the store tier's listener
        self.add(kind, STORE, hashes)

    def add(self, kind: str, medium: worker_pb2.KvMedium, hashes: list[int]) -> None:
        with self._lock:
            if self.overflowed or self.closed:
                return
            wake = not self._events
            if wake:
                self.oldest_at = time.time()
            self._events.append((kind, medium, list(hashes)))
            self._pending += len(hashes)
            if self._pending > self._max_pending:
                self.overflowed, wake = True, True
        if wake:
            try:
                self._loop.call_soon_threadsafe(self.ready.set)
            except RuntimeError:
                pass  # the loop is closed: the worker is shutting down

    def take(self) -> tuple[list[tuple[str, worker_pb2.KvMedium, list[int]]], float]:
        """The events piled up, and the wall clock when the oldest of them happened."""
        with self._lock:
            events = list(self._events)
            self._events.clear()
            self._pending = 0
            self.ready.clear()
            return events, self.oldest_at

    def close(self) -> None:
        with self._lock:
            self.closed = True
        self._loop.call_soon_threadsafe(self.ready.set)


class KvEventsServicer(worker_pb2_grpc.KvEventsServicer):
    """Streams one worker's prefix-cache events to each subscriber (see the module docstring)."""

    def __init__(self, engine: EngineAPI, max_pending: int = 1_000_000,
                 min_batch_interval_s: float = MIN_BATCH_INTERVAL_S) -> None:
        self.engine = engine
        self.max_pending = max_pending
        self.min_batch_interval_s = min_batch_interval_s
        self._subscriptions: set[_Subscription] = set()

    @property
    def subscribers(self) -> int:
        return len(self._subscriptions)

    def close(self) -> None:
        """End every stream (before the server's graceful stop, which would wait for them)."""
        for subscription in list(self._subscriptions):
            subscription.close()

    async def Subscribe(self, request: worker_pb2.KvEventsRequest, context: grpc.aio.ServicerContext):
        pages = self.engine.pages
        tier = self.engine.hicache  # a libkv.store.StoreTier with --enable-hierarchical-cache
        store = tier.location if tier is not None else ""
        subscription = _Subscription(asyncio.get_running_loop(), self.max_pending)
        snapshot = pages.watch_cache(subscription)
        stored = tier.watch(subscription.store_listener) if tier is not None else []
        self._subscriptions.add(subscription)
        try:
            yield worker_pb2.KvEventBatch(snapshot=True, page_size=pages.page_size, store=store,
                                          oldest_event_unix_s=time.time(), events=[
                worker_pb2.KvEvent(kind=worker_pb2.KV_EVENT_KIND_STORED, medium=medium, page_hashes=hashes)
                for medium, hashes in ((DEVICE, snapshot), (STORE, stored)) if hashes])
            while True:
                await subscription.ready.wait()
                if subscription.overflowed:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        f"more than {self.max_pending} KV events behind: subscribe again")
                if subscription.closed:
                    return
                events, oldest_at = subscription.take()
                if events:
                    yield worker_pb2.KvEventBatch(page_size=pages.page_size, store=store,
                                                  oldest_event_unix_s=oldest_at, events=[
                        worker_pb2.KvEvent(kind=_KINDS[kind], medium=medium, page_hashes=hashes)
                        for kind, medium, hashes in events])
                    await asyncio.sleep(self.min_batch_interval_s)  # what changes meanwhile goes as one
        finally:
            pages.unwatch_cache(subscription)
            if tier is not None:
                tier.unwatch(subscription.store_listener)
            self._subscriptions.discard(subscription)
