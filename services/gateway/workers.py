"""The workers the gateway may route to, their circuit breakers, and the router that picks among them.

WorkerPool holds a WorkerHandle per worker, keyed by its gRPC address: a worker restarted on the
same address is the same routing target (the registry replaces its entry; the gateway starts it
with a fresh breaker). discovery.py fills the pool from the command line and from the registry's
Watch stream; the Router reads it; metrics read it at scrape time. Everything runs on the
gateway's event loop.

Circuit breaker of one worker (stop sending traffic to a worker that keeps failing). The router
asks `available()` before choosing a worker, and reports each outcome:

    CLOSED     traffic flows; `failure_threshold` failures in a row -> OPEN
    OPEN       no traffic for `cooldown_s`; then -> HALF_OPEN (checked lazily on the next query)
    HALF_OPEN  one trial at a time: the router takes the slot with `acquire()`; a success (or a
               passing health probe) -> CLOSED, a failure -> OPEN again with a fresh cool-down

Only failures that say something about the worker count (UNAVAILABLE, timeouts); a client's bad
request does not. The clock is injectable so tests drive the state machine exactly.

Routing one attempt of a request (`Router.pick`): the decode policy chooses among decode and
colocated workers (a decode worker only while some prefill worker is available to pair it with,
or if it runs prompts itself when none is: conditional disaggregation); if it chose a decode
worker, the prefill policy chooses its prefill worker, if there is one. Workers whose circuit is
open, or that this request already failed on (`exclude`), are not candidates. The returned Route
holds both workers' in-flight slots and breaker trial slots until `finish` says how the attempt
went.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.channels import open_channel
from services.common.image_drop import DropTarget
from services.common.security import GrpcSecurity
from services.gateway.errors import GatewayError
from services.gateway.kv_view import KvCacheView

if TYPE_CHECKING:  # the policies choose among WorkerHandles: a runtime import would be circular
    from services.gateway.policies.base import Policy

DROP_QUERY_TIMEOUT_S = 5.0

log = logging.getLogger("pdserve.gateway")

PREFILL, DECODE, COLOCATED = "prefill", "decode", "colocated"

ROLE_FROM_PROTO = {common_pb2.WORKER_ROLE_PREFILL: PREFILL, common_pb2.WORKER_ROLE_DECODE: DECODE,
                   common_pb2.WORKER_ROLE_COLOCATED: COLOCATED}


class BreakerState(enum.Enum):
    CLOSED = "closed"
    HALF_OPEN = "half_open"
    OPEN = "open"

    @property
    def gauge_value(self) -> int:
        """The number exported in metrics: 0 closed, 1 half-open, 2 open."""
        return {"closed": 0, "half_open": 1, "open": 2}[self.value]


class CircuitBreaker:
    """Closed/open/half-open state of one worker. Not thread-safe: used from the event loop."""

    def __init__(self, failure_threshold: int = 3, cooldown_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._trial_in_flight = False

    @property
    def state(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.cooldown_s:
            self._state = BreakerState.HALF_OPEN
            self._trial_in_flight = False
        return self._state

    @property
    def consecutive_failures(self) -> int:
        return self._failures

    def available(self) -> bool:
        """May the router send a request now? (HALF_OPEN: only while no trial is in flight.)"""
        state = self.state
        return state is BreakerState.CLOSED or (state is BreakerState.HALF_OPEN and not self._trial_in_flight)

    def acquire(self) -> None:
        """The router chose this worker: in HALF_OPEN this request is the trial."""
        if self.state is BreakerState.HALF_OPEN:
            self._trial_in_flight = True

    def record_success(self) -> None:
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._trial_in_flight = False

    def record_failure(self) -> None:
        state = self.state
        self._failures += 1
        if state is BreakerState.HALF_OPEN or self._failures >= self.failure_threshold:
            self._open()

    def release(self) -> None:
        """A request finished without saying anything about the worker (client abort, bad input):
        free the half-open trial slot without changing state."""
        self._trial_in_flight = False

    def _open(self) -> None:
        self._state = BreakerState.OPEN
        self._opened_at = self._clock()
        self._trial_in_flight = False

    def probe_due(self) -> bool:
        """Is the worker waiting for a probe (half-open with no trial running)?"""
        return self.state is BreakerState.HALF_OPEN and not self._trial_in_flight


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
        return cls(queued=queued, running=load.running, free_pages=load.free_pages,
                   total_pages=load.total_pages)

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
    # LoRA adapters it serves, name -> the key its pages are hashed under, from its registration and
    # heartbeats; None: not known (a static worker), so any adapter may be asked of it
    lora_adapters: dict[str, str] | None = None
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
    _image_drop_port: int | None = field(default=None, repr=False)  # None: not asked yet

    @property
    def key(self) -> str:
        return self.address

    def serves(self, lora: str | None) -> bool:
        """May a request under LoRA adapter `lora` (None: the base model) be sent here?"""
        return lora is None or self.lora_adapters is None or lora in self.lora_adapters

    def lora_cache_key(self, lora: str | None) -> str | None:
        """The key this worker hashes `lora`'s pages under (None: the base model, or not known)."""
        return None if lora is None or self.lora_adapters is None else self.lora_adapters.get(lora)

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

    async def image_drop(self) -> DropTarget | None:
        """Where this worker takes large images beside gRPC (services/common/image_drop.py), asked
        once (GetImageDrop) and remembered; None where it has none, under TLS, or it did not say
        (asked again next time)."""
        if self.security.tls:
            return None  # the drop is plain TCP: images stay inside the encrypted call
        if self._image_drop_port is None:
            try:
                info = await self.worker_stub().GetImageDrop(worker_pb2.GetImageDropRequest(),
                                                             timeout=DROP_QUERY_TIMEOUT_S)
                self._image_drop_port = info.port
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:  # an older worker never will
                    return None
                self._image_drop_port = 0
        if not self._image_drop_port:
            return None
        host = self.address.rpartition(":")[0].strip("[]")
        return DropTarget(host, self._image_drop_port, self.security.secret)

    def forget_image_drop(self) -> None:
        """An upload failed: ask again before the next (a restarted worker has another port)."""
        self._image_drop_port = None

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
            reported: ReportedLoad | None = None, local_prefill: bool = False,
            page_size: int = 0, lora_adapters: dict[str, str] | None = None) -> WorkerHandle:
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
            if lora_adapters is not None:
                existing.lora_adapters = lora_adapters
            return existing
        if existing is not None:
            self.remove(address, reason="replaced")
        handle = WorkerHandle(address=address, role=role, model=model, worker_id=worker_id, static=static,
                              local_prefill=local_prefill, reported=reported or ReportedLoad(),
                              breaker=self._breaker_factory(), security=self._security, page_size=page_size,
                              lora_adapters=lora_adapters)
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


class NoWorkersError(GatewayError):
    """No worker can take the request now (503)."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message, code="no_healthy_workers")


class UnknownAdapterError(NoWorkersError):
    """No worker serves the LoRA adapter a request names (404, in vLLM's words)."""

    def __init__(self, lora: str) -> None:
        GatewayError.__init__(self, 404, f"The model `{lora}` does not exist.", param="model",
                              code="model_not_found")


def pair_candidates(workers: Sequence[WorkerHandle], lora: str | None = None
                    ) -> tuple[list[WorkerHandle], list[WorkerHandle]]:
    """(prefill workers, decode-or-colocated workers that can take a request under LoRA adapter
    `lora`) of `workers`: a decode worker only while a prefill worker that holds the adapter from the
    same files is among them, or it runs prompts itself."""
    prefills = [w for w in workers if w.role == PREFILL]
    decodes = [w for w in workers if w.role == COLOCATED or (
        w.role == DECODE and (w.local_prefill or same_adapter_files(prefills, w, lora)))]
    return prefills, decodes


def same_adapter_files(prefills: Sequence[WorkerHandle], decode: WorkerHandle, lora: str | None
                       ) -> list[WorkerHandle]:
    """The prefill workers that hold `lora` from the same files as `decode` (equal keys; a key not
    known is taken to agree): another one would refuse decode's handshake."""
    key = decode.lora_cache_key(lora)
    return [p for p in prefills if key is None or p.lora_cache_key(lora) in (None, key)]


def servable_adapters(workers: Sequence[WorkerHandle], names: Iterable[str]) -> set[str]:
    """The LoRA adapters of `names` that some route of `workers` serves whole: a colocated worker
    holding it, or a decode worker holding it with a prefill worker that holds it from the same
    files (or running prompts itself). A worker whose adapters are not known (static) counts as
    holding every one."""
    return {name for name in names if pair_candidates([w for w in workers if w.serves(name)], name)[1]}


def listed_adapters(workers: Iterable[WorkerHandle]) -> set[str]:
    """Every LoRA adapter some worker of `workers` says it serves."""
    return {name for w in workers for name in (w.lora_adapters or {})}


@dataclass
class Route:
    """One attempt's workers. `finish(failed=...)` must be called exactly once."""

    decode: WorkerHandle
    prefill: WorkerHandle | None
    _finished: bool = False

    @property
    def workers(self) -> tuple[WorkerHandle, ...]:
        return (self.decode,) if self.prefill is None else (self.prefill, self.decode)

    def describe(self) -> str:
        if self.prefill is None:
            return f"{self.decode.role} {self.decode.address}"
        return f"prefill {self.prefill.address} -> decode {self.decode.address}"

    def finish(self, *, succeeded: bool = False, failed: Iterable[WorkerHandle] = ()) -> None:
        """Release the slots. `succeeded`: every worker of the route did its part (closes a
        half-open breaker). `failed`: workers to charge a failure to; the others are released
        without a verdict (client abort, bad request)."""
        if self._finished:
            return
        self._finished = True
        failed = set(failed)
        for worker in self.workers:
            worker.end()
            if worker in failed:
                worker.breaker.record_failure()
            elif succeeded:
                worker.breaker.record_success()
            else:
                worker.breaker.release()


class Router:
    """Chooses routes from a WorkerPool with one policy for prefill and one for decode."""

    def __init__(self, pool: WorkerPool, prefill_policy: Policy, decode_policy: Policy) -> None:
        self.pool = pool
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        pool.on_removed(self._forget)

    def _forget(self, worker: WorkerHandle) -> None:
        self.prefill_policy.forget(worker)
        if self.decode_policy is not self.prefill_policy:
            self.decode_policy.forget(worker)

    def candidates(self, model: str, exclude: Iterable[str] = (), lora: str | None = None
                   ) -> tuple[list[WorkerHandle], list[WorkerHandle]]:
        """(prefill candidates, decode-or-colocated candidates) available for `model` now, under
        LoRA adapter `lora`: only workers that serve it (a decode one only with a prefill that does)."""
        excluded = set(exclude)
        usable = [w for w in self.pool.routable(model)
                  if w.key not in excluded and w.breaker.available() and w.serves(lora)]
        return pair_candidates(usable, lora)

    def pick(self, model: str, prompt_token_ids: Sequence[int], exclude: Iterable[str] = (),
             lora: str | None = None) -> Route:
        """A route for one attempt under LoRA adapter `lora` (None: the base model); raises
        UnknownAdapterError (404) when no worker serves the adapter, NoWorkersError (503) when
        nothing can serve the request now."""
        prefills, decodes = self.candidates(model, exclude, lora)
        if not decodes:
            if lora is not None and not servable_adapters(self.pool.routable(model), [lora]):
                raise UnknownAdapterError(lora)
            raise NoWorkersError(self._why_none(model, exclude))
        decode = self.decode_policy.choose(decodes, prompt_token_ids, lora)
        prefills = same_adapter_files(prefills, decode, lora)
        prefill = (self.prefill_policy.choose(prefills, prompt_token_ids, lora)
                   if decode.role == DECODE and prefills else None)
        route = Route(decode=decode, prefill=prefill)
        for worker in route.workers:
            worker.breaker.acquire()
            worker.begin()
        return route

    def _why_none(self, model: str, exclude: Iterable[str]) -> str:
        known = self.pool.routable(model)
        if not known:
            return f"no workers serve model {model!r}"
        roles = sorted({w.role for w in known})
        if roles == [PREFILL]:
            return f"model {model!r} has prefill workers but no decode or colocated worker"
        if roles == [DECODE] or (set(roles) == {DECODE, PREFILL}
                                 and not any(w.breaker.available() for w in known if w.role == PREFILL)):
            return f"model {model!r} has no healthy prefill worker for its decode workers"
        tried = set(exclude)
        if tried:
            return (f"every worker for model {model!r} failed this request or is unhealthy (tried "
                    f"{len(tried)})")
        return f"every worker for model {model!r} is unhealthy (circuit open)"
