"""Fill the WorkerPool: static workers from the command line, live ones from the bootstrap registry.

Registry: one Watch stream (RegistryClient.watch reconnects and reconciles by itself). JOINED and
UPDATED add or refresh a worker (UPDATED carries its heartbeat load and LoRA adapters), LEFT
removes it, so joins and leaves take effect without a restart. Only workers of the served model
are routed to (the gateway tokenizes with that model's tokenizer); others are logged once and
ignored. A static worker stays in the pool even if the registry reports it gone. With a `check`
(a gateway that learned its model from the workers), a new worker joins the pool only once its
GetModelInfo matches that model, tokenizer files included.

LEFT depends on its reason:
- "lease expired": the worker stopped heartbeating (frozen, cut off). It is removed and the calls
  open on it are cut, so they fail or retry now instead of waiting for a worker that may never
  answer.
- "left while the registry was unreachable": the registry came back without it, which after a
  registry restart is true of every worker until it registers again (within one heartbeat
  interval). So it stays routable for `rejoin_grace_s` and is removed only if it has not
  rejoined by then.
- "deregistered", "replaced": removed; calls already open on it finish (graceful shutdown).

Health probes: a worker whose circuit is half-open (cool-down over), or that has not answered
yet, gets a gRPC health check; a SERVING answer closes the circuit and marks it reachable
(readiness counts only reachable workers), anything else opens it again for another cool-down.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.v1 import bootstrap_pb2
from services.common.registry_client import REASON_UNREACHABLE, RegistryClient
from services.common.security import GrpcSecurity
from services.gateway.config import StaticWorker
from services.gateway.workers import ROLE_FROM_PROTO, ReportedLoad, WorkerHandle, WorkerPool

log = logging.getLogger("pdserve.gateway")

_JOINED = bootstrap_pb2.WORKER_EVENT_TYPE_JOINED
_UPDATED = bootstrap_pb2.WORKER_EVENT_TYPE_UPDATED
_LEFT = bootstrap_pb2.WORKER_EVENT_TYPE_LEFT
_SYNCED = bootstrap_pb2.WORKER_EVENT_TYPE_SYNCED


async def stop_task(task: asyncio.Task | None) -> None:
    """Cancel a background task (if there is one) and wait until it has ended."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


def add_static_workers(pool: WorkerPool, workers: Iterable[StaticWorker], model: str) -> None:
    for worker in workers:
        pool.add(worker.address, worker.role, model, static=True)


def lora_adapters_of(info: bootstrap_pb2.WorkerInfo) -> dict[str, str]:
    """A registered worker's LoRA adapters: name -> the key its pages are hashed under."""
    return {adapter.name: adapter.cache_key for adapter in info.lora_adapters}


class WorkerCheck(Protocol):
    """Decides whether a newly discovered worker may be routed to (services.gateway.model_source)."""

    def submit(self, address: str, role: str, worker_id: str, admit: Callable[[], object]) -> None:
        """Check the worker in the background; call `admit` if it passes. Repeated submits of a
        worker being checked or refused already are ignored."""

    def forget(self, address: str, worker_id: str) -> None:
        """The worker left: drop its pending check or refusal."""

    async def close(self) -> None: ...


class RegistryDiscovery:
    """Keeps `pool` equal to the registry's workers of `model` (plus the static ones)."""

    def __init__(self, pool: WorkerPool, registry_address: str, model: str, *,
                 security: GrpcSecurity | None = None, rejoin_grace_s: float = 15.0,
                 check: WorkerCheck | None = None) -> None:
        self.pool = pool
        self.check = check
        self.registry_address = registry_address
        self.model = model
        self.security = security or GrpcSecurity()
        self.rejoin_grace_s = rejoin_grace_s
        self.synced = asyncio.Event()
        self._ignored_models: set[str] = set()
        self._client: RegistryClient | None = None
        self._task: asyncio.Task | None = None
        self._pending_removal: dict[str, asyncio.TimerHandle] = {}  # address -> deferred removal

    def start(self) -> None:
        self._client = RegistryClient(self.registry_address, security=self.security)
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
        address = info.grpc_address
        current = self.pool.get(address)
        new_process = current is None or current.worker_id not in ("", info.worker_id)
        if event.type in (_JOINED, _UPDATED) and self.check is not None and new_process:
            # a worker the gateway does not route to yet (or a new process at a known address):
            # it joins once its model info matches
            self.check.submit(address, role, info.worker_id, lambda: self.pool.add(
                address, role, info.model, worker_id=info.worker_id,
                reported=ReportedLoad.from_proto(info.load), local_prefill=info.local_prefill,
                lora_adapters=lora_adapters_of(info)))
            return
        if event.type in (_JOINED, _UPDATED):
            pending = self._pending_removal.pop(address, None)
            if pending is not None:
                pending.cancel()
                log.info("worker %s %s is back in the registry", role, address)
            self.pool.add(address, role, info.model, worker_id=info.worker_id,
                          reported=ReportedLoad.from_proto(info.load), local_prefill=info.local_prefill,
                          page_size=info.kv_layout.page_size, lora_adapters=lora_adapters_of(info))
        elif event.type == _LEFT:
            if self.check is not None:
                self.check.forget(address, info.worker_id)
            current = self.pool.get(address)
            # a LEFT for an older process at the same address must not remove its successor
            if current is None or current.static or current.worker_id not in ("", info.worker_id):
                return
            if event.reason == REASON_UNREACHABLE:
                self._remove_unless_rejoined(current)
                return
            self.pool.remove(address, reason=event.reason or "left")
            if event.reason == "lease expired":
                cut = current.cut("stopped heartbeating (registry lease expired)")
                if cut:
                    log.warning("worker %s %s: lease expired; failed its %d open call(s)", role, address, cut)

    def _remove_unless_rejoined(self, worker: WorkerHandle) -> None:
        """Keep a worker the registry lost track of routable for a grace period (see module doc).
        Its id is forgotten, so whatever id it registers with next is taken as the same worker."""
        if worker.address in self._pending_removal:
            return
        worker.worker_id = ""

        def remove() -> None:
            self._pending_removal.pop(worker.address, None)
            if self.pool.get(worker.address) is worker:
                self.pool.remove(worker.address,
                                 reason=f"not back in the registry within {self.rejoin_grace_s:g}s")

        loop = asyncio.get_running_loop()
        self._pending_removal[worker.address] = loop.call_later(self.rejoin_grace_s, remove)

    async def close(self) -> None:
        if self.check is not None:
            await self.check.close()
        for pending in self._pending_removal.values():
            pending.cancel()
        self._pending_removal.clear()
        await stop_task(self._task)
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
            due = [worker for worker in self.pool.all()
                   if worker.breaker.probe_due() or (not worker.reachable and worker.breaker.available())]
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
            if worker.reachable:
                log.info("worker %s %s passed its health probe: back in rotation", worker.role,
                         worker.address)
            worker.reachable = True
            worker.breaker.record_success()
        else:
            worker.breaker.record_failure()
        return serving

    async def close(self) -> None:
        await stop_task(self._task)
