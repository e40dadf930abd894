"""Follow every worker's KV events (pdserve.v1.KvEvents), so cache_aware routes on real cache state.

One task per worker in the pool subscribes on the worker's channel and applies the snapshot and
the deltas to `worker.kv_cache` (a KvCacheView): pages in the worker's own pool and, from a worker
with the store tier, pages in the cluster-wide store (the event's medium). When the stream breaks
the view is dropped (it may have missed events) and the task subscribes again after a pause; a
worker that does not serve
KvEvents (UNIMPLEMENTED) is left unknown. Workers joining and leaving are picked up by comparing
the pool with the tasks every `reconcile_s`. Each delta batch's lag (this gateway's clock when it is
applied minus the worker's stamp of its oldest event) goes to `on_lag`: the gateway's
`gateway_kv_event_lag_seconds` histogram.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from protos.v1 import worker_pb2, worker_pb2_grpc
from services.gateway.workers import WorkerHandle, WorkerPool

log = logging.getLogger("pdserve.gateway")

_STORED, _REMOVED = worker_pb2.KV_EVENT_KIND_STORED, worker_pb2.KV_EVENT_KIND_REMOVED
_STORE = worker_pb2.KV_MEDIUM_STORE  # DEVICE and UNSPECIFIED (a worker naming no medium) are its own pool


def apply_batch(worker: WorkerHandle, batch: worker_pb2.KvEventBatch) -> None:
    """Apply one KvEventBatch to the worker's view, in event order."""
    view = worker.kv_cache
    if batch.snapshot:
        view.apply(snapshot=True)
        view.store = batch.store
        view.page_size = worker.page_size or batch.page_size
        if worker.page_size and batch.page_size and worker.page_size != batch.page_size:
            log.warning("worker %s registered pages of %d tokens but publishes hashes of %d-token pages",
                        worker.address, worker.page_size, batch.page_size)
            view.page_size = batch.page_size  # the hashes are made with this one
    for event in batch.events:
        in_store = event.medium == _STORE
        if event.kind == _STORED:
            view.apply(False, stored=event.page_hashes, in_store=in_store)
        elif event.kind == _REMOVED:
            view.apply(False, removed=event.page_hashes, in_store=in_store)
    if batch.snapshot:
        view.synced = True


class KvEventSubscriptions:
    """Keeps one KvEvents subscription per worker of the pool."""

    def __init__(self, pool: WorkerPool, *, retry_s: float = 1.0, reconcile_s: float = 0.5,
                 on_lag: Callable[[float], None] | None = None) -> None:
        self.pool = pool
        self.on_lag = on_lag
        self.retry_s = retry_s
        self.reconcile_s = reconcile_s
        self._tasks: dict[WorkerHandle, asyncio.Task] = {}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kv-events")

    async def _run(self) -> None:
        while True:
            self.reconcile()
            await asyncio.sleep(self.reconcile_s)

    def reconcile(self) -> None:
        workers = set(self.pool.all())
        for worker in workers - set(self._tasks):
            self._tasks[worker] = asyncio.get_running_loop().create_task(
                self._follow(worker), name=f"kv-events-{worker.address}")
        for worker in set(self._tasks) - workers:
            self._tasks.pop(worker).cancel()
            worker.kv_cache.forget()

    async def _follow(self, worker: WorkerHandle) -> None:
        # Stop once the worker left the pool: its channel is closed, and asking for it would open
        # a new one nobody closes.
        while self.pool.get(worker.address) is worker:
            try:
                stream = worker_pb2_grpc.KvEventsStub(worker.channel).Subscribe(worker_pb2.KvEventsRequest())
                async for batch in stream:
                    apply_batch(worker, batch)
                    if self.on_lag is not None and not batch.snapshot and batch.oldest_event_unix_s:
                        self.on_lag(max(0.0, time.time() - batch.oldest_event_unix_s))
                worker.kv_cache.forget()  # the worker ended the stream (shutting down)
            except grpc.aio.AioRpcError as exc:
                worker.kv_cache.forget()
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("worker %s publishes no KV events: cache_aware guesses its cache",
                             worker.address)
                    return
                log.debug("KV events of %s: %s %s", worker.address, exc.code().name, exc.details())
            except asyncio.CancelledError:
                raise
            except Exception:
                worker.kv_cache.forget()
                log.exception("KV events of %s failed", worker.address)
            await asyncio.sleep(self.retry_s)

    async def close(self) -> None:
        tasks = list(self._tasks.values()) + ([self._task] if self._task else [])
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
