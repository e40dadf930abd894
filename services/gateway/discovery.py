"""Fill the WorkerPool: static workers from the command line, live ones from the bootstrap registry.

Registry: one Watch stream (RegistryClient.watch reconnects and reconciles by itself). JOINED and
UPDATED add or refresh a worker (UPDATED carries its heartbeat load), LEFT removes it, so joins
and leaves take effect without a restart. Only workers of the served model are routed to (the
gateway tokenizes with that model's tokenizer); others are logged once and ignored. A static
worker stays in the pool even if the registry reports it gone.

Health probes: a worker whose circuit is half-open (cool-down over) gets a gRPC health check; a
SERVING answer closes the circuit, anything else opens it again for another cool-down.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.v1 import bootstrap_pb2
from services.bootstrap.client import RegistryClient
from services.gateway.config import StaticWorker
from services.gateway.workers import ROLE_FROM_PROTO, ReportedLoad, WorkerHandle, WorkerPool

log = logging.getLogger("pdserve.gateway")

_JOINED = bootstrap_pb2.WORKER_EVENT_TYPE_JOINED
_UPDATED = bootstrap_pb2.WORKER_EVENT_TYPE_UPDATED
_LEFT = bootstrap_pb2.WORKER_EVENT_TYPE_LEFT
_SYNCED = bootstrap_pb2.WORKER_EVENT_TYPE_SYNCED


def add_static_workers(pool: WorkerPool, workers: Iterable[StaticWorker], model: str) -> None:
    for worker in workers:
        pool.add(worker.address, worker.role, model, static=True)


class RegistryDiscovery:
    """Keeps `pool` equal to the registry's workers of `model` (plus the static ones)."""

    def __init__(self, pool: WorkerPool, registry_address: str, model: str) -> None:
        self.pool = pool
        self.registry_address = registry_address
        self.model = model
        self.synced = asyncio.Event()
        self._ignored_models: set[str] = set()
        self._client: RegistryClient | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._client = RegistryClient(self.registry_address)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="registry-watch")

    async def _run(self) -> None:
        assert self._client is not None
        log.info("watching registry %s for workers of model %r", self.registry_address, self.model)
        try:
            async for event in self._client.watch():
                self.apply(event)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("registry watch on %s stopped", self.registry_address)

    def apply(self, event: bootstrap_pb2.WorkerEvent) -> None:
        """Apply one registry event to the pool."""
        if event.type == _SYNCED:
            if not self.synced.is_set():
                log.info("registry %s synced: %d worker(s) of %r", self.registry_address,
                         len(self.pool.routable(self.model)), self.model)
            self.synced.set()
            return
        info = event.worker
        role = ROLE_FROM_PROTO.get(info.role)
        if role is None or not info.grpc_address:
            return
        if info.model != self.model:
            if info.model not in self._ignored_models:
                self._ignored_models.add(info.model)
                log.warning("ignoring workers of model %r: this gateway serves %r (its tokenizer)",
                            info.model, self.model)
            return
        if event.type in (_JOINED, _UPDATED):
            self.pool.add(info.grpc_address, role, info.model, worker_id=info.worker_id,
                          reported=ReportedLoad.from_proto(info.load))
        elif event.type == _LEFT:
            current = self.pool.get(info.grpc_address)
            # a LEFT for an older process at the same address must not remove its successor
            if current is not None and not current.static and current.worker_id in ("", info.worker_id):
                self.pool.remove(info.grpc_address, reason=event.reason or "left")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._client is not None:
            await self._client.close()


class HealthProber:
    """Every `interval_s`, health-checks the workers whose circuit waits for a probe."""

    def __init__(self, pool: WorkerPool, interval_s: float = 1.0, timeout_s: float = 1.0) -> None:
        self.pool = pool
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="health-prober")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            due = [worker for worker in self.pool.all() if worker.breaker.probe_due()]
            if due:
                await asyncio.gather(*(self.probe(worker) for worker in due))

    async def probe(self, worker: WorkerHandle) -> bool:
        """One health check of `worker`; updates its breaker and returns whether it is SERVING."""
        worker.breaker.acquire()  # the probe is the half-open trial: no request races it
        try:
            response = await health_pb2_grpc.HealthStub(worker.channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=self.timeout_s)
            serving = response.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            serving = False
        except Exception:
            log.exception("health probe of %s failed", worker.address)
            serving = False
        if serving:
            log.info("worker %s %s passed its health probe: back in rotation", worker.role, worker.address)
            worker.breaker.record_success()
        else:
            worker.breaker.record_failure()
        return serving

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
