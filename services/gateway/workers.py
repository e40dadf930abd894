"""The workers the gateway may route to (WorkerPool) and what it knows about each (WorkerHandle).

Workers are keyed by their gRPC address: a worker restarted on the same address is the same
routing target (the registry replaces its entry; the gateway starts it with a fresh breaker).
discovery.py fills the pool from the command line and from the registry's Watch stream; the
router reads it; metrics read it at scrape time. Everything runs on the gateway's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from protos.v1 import common_pb2, worker_pb2_grpc
from services.common.channels import open_channel
from services.common.security import GrpcSecurity
from services.gateway.circuit_breaker import CircuitBreaker
from services.gateway.kv_view import KvCacheView

log = logging.getLogger("pdserve.gateway")

PREFILL, DECODE, COLOCATED = "prefill", "decode", "colocated"

ROLE_FROM_PROTO = {common_pb2.WORKER_ROLE_PREFILL: PREFILL, common_pb2.WORKER_ROLE_DECODE: DECODE,
                   common_pb2.WORKER_ROLE_COLOCATED: COLOCATED}


@dataclass(frozen=True)
class ReportedLoad:
    """A worker's queues as of its last registry heartbeat (all zero for static workers)."""

    queued: int = 0        # everything not yet in the running batch
    running: int = 0
    free_pages: int = 0
    total_pages: int = 0

    @classmethod
    def from_proto(cls, load: common_pb2.WorkerLoad) -> ReportedLoad:
        queued = (load.bootstrap + load.waiting + load.inflight + load.prealloc + load.transfer
                  + load.retracted)
        return cls(queued=queued, running=load.running, free_pages=load.free_pages, total_pages=load.total_pages)

    @property
    def active(self) -> int:
        return self.queued + self.running


@dataclass(eq=False)
class WorkerHandle:
    """One routing target. `inflight` counts this gateway's open requests on it (decode and
    colocated: open Generate calls; prefill: requests whose prompt it was chosen for).

    `reachable` turns true once the worker answered (a health probe or a request): readiness
    counts only such workers. `cut(reason)` fails the calls open on it at once (its registry
    lease expired: it froze or was cut off, so those calls would otherwise wait forever); the
    dispatcher tells such a call from a client's cancellation with `cut_reason(call)`."""

    address: str
    role: str
    model: str
    worker_id: str = ""
    static: bool = False
    local_prefill: bool = False  # decode only: runs prompts itself when no prefill worker can
    page_size: int = 0  # tokens per KV page, from its registration (0: static, not known yet)
    kv_cache: KvCacheView = field(default_factory=KvCacheView)  # its prefix cache (kv_events.py)
    reported: ReportedLoad = field(default_factory=ReportedLoad)
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    security: GrpcSecurity = field(default_factory=GrpcSecurity, repr=False)
    inflight: int = 0
    reachable: bool = False
    _channel: grpc.aio.Channel | None = field(default=None, repr=False)
    _retired: bool = field(default=False, repr=False)
    _calls: set = field(default_factory=set, repr=False)
    _cut: dict = field(default_factory=dict, repr=False)  # call -> why it was cut

    @property
    def key(self) -> str:
        return self.address

    @property
    def load(self) -> tuple[int, int]:
        """What load-aware policies compare: this gateway's in-flight count first (exact and
        current), the registry's reported queue as a tie-breaker (other gateways' traffic)."""
        return self.inflight, self.reported.active

    @property
    def channel(self) -> grpc.aio.Channel:
        if self._channel is None:
            self._channel = open_channel(self.address, self.security)
        return self._channel

    def track(self, call: grpc.aio.Call) -> None:
        self._calls.add(call)

    def untrack(self, call: grpc.aio.Call) -> None:
        self._calls.discard(call)
        self._cut.pop(call, None)

    def cut(self, reason: str) -> int:
        """Cancel every call open on this worker, remembering why; returns how many."""
        calls = list(self._calls)
        for call in calls:
            self._cut[call] = reason
            call.cancel()
        return len(calls)

    def cut_reason(self, call: grpc.aio.Call) -> str | None:
        return self._cut.get(call)

    def worker_stub(self) -> worker_pb2_grpc.WorkerStub:
        return worker_pb2_grpc.WorkerStub(self.channel)

    def begin(self) -> None:
        self.inflight += 1

    def end(self) -> None:
        self.inflight -= 1
        if self._retired and self.inflight == 0:
            self._close_channel()

    def retire(self) -> None:
        """The worker left: close its channel once the requests still on it have ended."""
        self._retired = True
        if self.inflight == 0:
            self._close_channel()

    def _close_channel(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            # close() is a coroutine; run it in the background (this may be called from sync code).
            task = asyncio.get_running_loop().create_task(channel.close())
            _background.add(task)
            task.add_done_callback(_background.discard)


_background: set[asyncio.Task] = set()  # keeps close() tasks referenced until they finish


class WorkerPool:
    """Workers by address. `on_removed` listeners (policies' per-worker state) hear of removals."""

    def __init__(self, breaker_factory: Callable[[], CircuitBreaker] = CircuitBreaker,
                 security: GrpcSecurity | None = None) -> None:
        self._workers: dict[str, WorkerHandle] = {}
        self._breaker_factory = breaker_factory
        self._security = security or GrpcSecurity()
        self._removed_listeners: list[Callable[[WorkerHandle], None]] = []

    def on_removed(self, listener: Callable[[WorkerHandle], None]) -> None:
        self._removed_listeners.append(listener)

    def get(self, address: str) -> WorkerHandle | None:
        return self._workers.get(address)

    def all(self) -> list[WorkerHandle]:
        return sorted(self._workers.values(), key=lambda w: (w.role, w.address))

    def routable(self, model: str | None = None) -> list[WorkerHandle]:
        return [w for w in self.all() if model is None or w.model == model]

    def models(self) -> list[str]:
        return sorted({w.model for w in self._workers.values()})

    def add(self, address: str, role: str, model: str, *, worker_id: str = "", static: bool = False,
            reported: ReportedLoad | None = None, local_prefill: bool = False, page_size: int = 0) -> WorkerHandle:
        """Add a worker, or update the one at `address`. A different role or worker id at the same
        address is a new process there: its handle (breaker, channel) is replaced."""
        existing = self._workers.get(address)
        if existing is not None and existing.role == role and existing.model == model and (
                not worker_id or not existing.worker_id or existing.worker_id == worker_id):
            existing.worker_id = worker_id or existing.worker_id
            existing.static = existing.static or static
            existing.local_prefill = local_prefill
            existing.page_size = page_size or existing.page_size
            if reported is not None:
                existing.reported = reported
            return existing
        if existing is not None:
            self.remove(address, reason="replaced")
        handle = WorkerHandle(address=address, role=role, model=model, worker_id=worker_id, static=static,
                              local_prefill=local_prefill, reported=reported or ReportedLoad(), breaker=self._breaker_factory(),
                              security=self._security, page_size=page_size)
        self._workers[address] = handle
        log.info("worker joined: %s %s (model %s%s)", role, address, model,
                 f", id {worker_id}" if worker_id else ", static")
        return handle

    def remove(self, address: str, *, reason: str = "") -> WorkerHandle | None:
        handle = self._workers.pop(address, None)
        if handle is None:
            return None
        log.info("worker left: %s %s (%s)", handle.role, address, reason or "removed")
        handle.retire()
        for listener in self._removed_listeners:
            listener(handle)
        return handle

    def close(self) -> None:
        for address in list(self._workers):
            self.remove(address, reason="gateway shutting down")
