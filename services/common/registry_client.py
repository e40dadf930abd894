"""RegistryClient: how workers and the gateway talk to the bootstrap registry.

Workers:
    registry = RegistryClient("127.0.0.1:8998")
    lease = await registry.register(worker_info)       # waits for the registry to come up
    registry.start_heartbeat(load=current_load)        # renews the lease, reports load
    registry.report_now()                              # a heartbeat at once (its LoRA adapters changed)
    ...
    await registry.close()                             # stops heartbeats, deregisters

If the registry forgets the worker (lease expired during a pause, registry restarted), the next
heartbeat gets NOT_FOUND and the client registers again under a new worker id (`worker_id`
changes; `on_registered` is called). If the registry is unreachable, heartbeats keep being tried
every interval.

Several registries: `RegistryClient("10.0.0.1:8998,10.0.0.2:8998")` names registry processes that
share one store (`pdserve bootstrap --registry-store etcd`). A call that finds its registry
unreachable (UNAVAILABLE, or no answer in time) is tried on the next one, and the client stays
there; a heartbeat through another registry renews the same lease, so the worker keeps its id.

Gateway:
    async for event in registry.watch(): ...           # JOINED / UPDATED / LEFT, SYNCED

`watch()` reconnects by itself (to the next registry, when given several) and reconciles, so its
consumer sees one consistent stream: after a reconnect it gets JOINED for new workers, UPDATED for
changed ones and LEFT (reason "left while the registry was unreachable") for workers that
vanished, then SYNCED again.

This module imports neither torch nor libkv (the gateway must stay torch-free).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from protos.v1 import bootstrap_pb2, bootstrap_pb2_grpc, common_pb2
from services.common.channels import open_channel
from services.common.security import GrpcSecurity

log = logging.getLogger("pdserve.registry_client")

# Codes after which another registry (sharing the store) may answer.
_FAILOVER_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

REASON_UNREACHABLE = "left while the registry was unreachable"

_JOINED = bootstrap_pb2.WORKER_EVENT_TYPE_JOINED
_UPDATED = bootstrap_pb2.WORKER_EVENT_TYPE_UPDATED
_LEFT = bootstrap_pb2.WORKER_EVENT_TYPE_LEFT
_SYNCED = bootstrap_pb2.WORKER_EVENT_TYPE_SYNCED


class RegistryClient:
    """A client of pdserve.v1.Bootstrap for one worker (register/heartbeat/deregister) or one
    gateway (list/watch). `address`: HOST:PORT, or several comma-separated (registries sharing a
    store; see the module docstring). Create it inside the event loop that will use it."""

    def __init__(self, address: str, *, security: GrpcSecurity | None = None, rpc_timeout_s: float = 5.0,
                 on_registered: Callable[[str], None] | None = None) -> None:
        self.addresses = [part.strip() for part in address.split(",") if part.strip()]
        if not self.addresses:
            raise ValueError(f"no registry address in {address!r}")
        self.rpc_timeout_s = rpc_timeout_s
        self.on_registered = on_registered
        self.worker_id: str | None = None
        self.lease: bootstrap_pb2.Lease | None = None
        self._worker: bootstrap_pb2.WorkerInfo | None = None
        self._load: Callable[[], common_pb2.WorkerLoad] | None = None
        self._lora_adapters: Callable[[], list[common_pb2.LoraAdapterRef]] | None = None
        # one heartbeat at a time: the registry keeps the lists of the last one it gets
        self._heartbeat_lock = asyncio.Lock()
        self._report_tasks: set[asyncio.Task] = set()
        self._heartbeat_task: asyncio.Task | None = None
        self._channels = [open_channel(one, security or GrpcSecurity()) for one in self.addresses]
        self._stubs = [bootstrap_pb2_grpc.BootstrapStub(channel) for channel in self._channels]
        self._current = 0

    @property
    def address(self) -> str:
        """The registry calls go to now."""
        return self.addresses[self._current]

    @property
    def _channel(self) -> grpc.aio.Channel:
        return self._channels[self._current]

    @property
    def _stub(self) -> bootstrap_pb2_grpc.BootstrapStub:
        return self._stubs[self._current]

    def _fail_over(self) -> None:
        if len(self.addresses) > 1:
            previous = self.address
            self._current = (self._current + 1) % len(self.addresses)
            log.warning("registry %s unreachable: switching to %s", previous, self.address)

    async def _unary(self, method: str, request, *, timeout_s: float, wait_for_ready: bool = False):
        """Call `method` on the current registry; on a failover code, on each other one in turn."""
        for attempt in range(len(self.addresses)):
            try:
                return await getattr(self._stub, method)(request, timeout=timeout_s,
                                                         wait_for_ready=wait_for_ready)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _FAILOVER_CODES or attempt == len(self.addresses) - 1:
                    raise
                self._fail_over()
        raise AssertionError("unreachable")

    async def __aenter__(self) -> RegistryClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- worker side -----------------------------------------------------------------------------

    async def register(self, worker: bootstrap_pb2.WorkerInfo, *,
                       wait_s: float = 30.0) -> bootstrap_pb2.Lease:
        """Register `worker` (its worker_id is ignored) and return the lease. Waits up to `wait_s`
        for the registry to become reachable. Raises grpc.aio.AioRpcError: INVALID_ARGUMENT or
        FAILED_PRECONDITION (layout/backend mismatch) are the worker's to fix; not retried."""
        self._worker = bootstrap_pb2.WorkerInfo()
        self._worker.CopyFrom(worker)
        self._worker.ClearField("worker_id")
        return await self._register(wait_for_ready=True, timeout_s=wait_s)

    async def _register(self, *, wait_for_ready: bool, timeout_s: float) -> bootstrap_pb2.Lease:
        assert self._worker is not None
        request = bootstrap_pb2.RegisterRequest(worker=self._worker)
        if self._load is not None:
            request.worker.load.CopyFrom(self._current_load())
        if self._lora_adapters is not None:
            del request.worker.lora_adapters[:]
            request.worker.lora_adapters.extend(self._lora_adapters())
        if len(self.addresses) == 1:
            response = await self._stub.Register(request, timeout=timeout_s, wait_for_ready=wait_for_ready)
        else:
            response = await self._register_any(request, timeout_s=timeout_s, wait_for_ready=wait_for_ready)
        self.worker_id, self.lease = response.worker_id, response.lease
        log.info("registered with %s as %s (heartbeat every %.1fs, lease %.1fs)", self.address,
                 self.worker_id, self.lease.heartbeat_interval_seconds, self.lease.ttl_seconds)
        if self.on_registered is not None:
            self.on_registered(self.worker_id)
        return self.lease

    async def _register_any(self, request: bootstrap_pb2.RegisterRequest, *, timeout_s: float,
                            wait_for_ready: bool) -> bootstrap_pb2.RegisterResponse:
        """Register through whichever registry answers; with `wait_for_ready`, keep going round
        them until `timeout_s` (waiting on one that is down would never try the others)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            left_s = deadline - asyncio.get_running_loop().time()
            try:
                return await self._unary("Register", request,
                                         timeout_s=max(min(left_s, self.rpc_timeout_s), 0.01))
            except grpc.aio.AioRpcError as exc:
                if not wait_for_ready or exc.code() not in _FAILOVER_CODES or left_s <= 0.5:
                    raise
            self._fail_over()
            await asyncio.sleep(0.5)

    def start_heartbeat(self, load: Callable[[], common_pb2.WorkerLoad] | None = None,
                        lora_adapters: Callable[[], list[common_pb2.LoraAdapterRef]] | None = None) -> None:
        """Renew the lease every heartbeat interval from a background task, sending `load()` and
        `lora_adapters()` each time (called on the event loop; they must be cheap and not block)."""
        if self.lease is None:
            raise RuntimeError("register() before start_heartbeat()")
        self._load = load
        self._lora_adapters = lora_adapters
        if self._heartbeat_task is None or self._heartbeat_task.done():
            self._heartbeat_task = asyncio.create_task(self._heartbeat_loop(), name="registry-heartbeat")

    async def stop_heartbeat(self) -> None:
        """Stop renewing the lease (it will expire unless deregistered)."""
        task, self._heartbeat_task = self._heartbeat_task, None
        for one in [task, *self._report_tasks]:
            if one is not None:
                one.cancel()
                try:
                    await one
                except asyncio.CancelledError:
                    pass

    def report_now(self) -> None:
        """Heartbeat at once in the background (what it reports changed: a LoRA adapter was loaded
        or unloaded), instead of at the next interval; failures are logged, as the loop's are."""
        if self.lease is None:
            return

        async def beat() -> None:
            try:
                await self.heartbeat()
            except grpc.aio.AioRpcError as exc:
                log.warning("heartbeat to registry %s failed: %s %s", self.address, exc.code().name,
                            exc.details())
            except RuntimeError:  # deregistered meanwhile: nothing to report
                pass

        task = asyncio.get_running_loop().create_task(beat(), name="registry-report")
        self._report_tasks.add(task)
        task.add_done_callback(self._report_tasks.discard)

    async def heartbeat(self) -> bootstrap_pb2.Lease:
        """Renew the lease once; if the registry no longer knows it (NOT_FOUND), register again.
        Heartbeats run one at a time, each reading the lists when it is sent, so the last one the
        registry gets is the newest."""
        async with self._heartbeat_lock:
            return await self._heartbeat_once()

    async def _heartbeat_once(self) -> bootstrap_pb2.Lease:
        if self.lease is None:  # deregistered while this heartbeat waited for the one before it
            raise RuntimeError("not registered")
        request = bootstrap_pb2.HeartbeatRequest(lease_id=self.lease.lease_id)
        if self._load is not None:
            request.load.CopyFrom(self._current_load())
        if self._lora_adapters is not None:
            request.lora_adapters.extend(self._lora_adapters())
        try:
            response = await self._unary("Heartbeat", request, timeout_s=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
            log.warning("registry %s forgot worker %s (%s): registering again", self.address,
                        self.worker_id, exc.details())
            return await self._register(wait_for_ready=False, timeout_s=self.rpc_timeout_s)
        self.lease = response.lease
        return self.lease

    async def _heartbeat_loop(self) -> None:
        while True:
            assert self.lease is not None
            await asyncio.sleep(self.lease.heartbeat_interval_seconds)
            try:
                await self.heartbeat()
            except grpc.aio.AioRpcError as exc:
                # Keep trying: the registry may be restarting; a NOT_FOUND then re-registers.
                log.warning("heartbeat to registry %s failed: %s %s", self.address, exc.code().name,
                            exc.details())

    def _current_load(self) -> common_pb2.WorkerLoad:
        assert self._load is not None
        try:
            return self._load()
        except Exception:  # a broken load probe must not cost the worker its lease
            log.exception("load probe failed; heartbeat sent without load")
            return common_pb2.WorkerLoad()

    async def deregister(self) -> None:
        """Leave the registry now (watchers see LEFT "deregistered"). Stops heartbeats first.
        A lease the registry no longer knows is not an error here."""
        await self.stop_heartbeat()
        lease, self.lease = self.lease, None
        if lease is None:
            return
        try:
            await self._unary("Deregister", bootstrap_pb2.DeregisterRequest(lease_id=lease.lease_id),
                              timeout_s=self.rpc_timeout_s)
            log.info("deregistered %s from %s", self.worker_id, self.address)
        except grpc.aio.AioRpcError as exc:
            log.warning("deregister %s from %s failed: %s %s", self.worker_id, self.address,
                        exc.code().name, exc.details())

    async def close(self) -> None:
        """Deregister if registered, then close the channel."""
        await self.deregister()
        for channel in self._channels:
            await channel.close()

    # -- gateway side --------------------------------------------------------------------------

    async def list(self, role: common_pb2.WorkerRole = common_pb2.WORKER_ROLE_UNSPECIFIED, model: str = "",
                   *, wait_for_ready: bool = False) -> list[bootstrap_pb2.WorkerInfo]:
        response = await self._unary("List", bootstrap_pb2.ListRequest(role=role, model=model),
                                     timeout_s=self.rpc_timeout_s, wait_for_ready=wait_for_ready)
        return list(response.workers)

    async def watch(self, role: common_pb2.WorkerRole = common_pb2.WORKER_ROLE_UNSPECIFIED,
                    model: str = "", *, reconnect: bool = True, min_backoff_s: float = 0.2,
                    max_backoff_s: float = 5.0
                    ) -> AsyncIterator[bootstrap_pb2.WorkerEvent]:
        """Worker events matching (role, model): the current workers as JOINED, one SYNCED, then
        changes. With `reconnect`, a broken stream is re-opened (with backoff) and its fresh
        snapshot reconciled against what was already reported (see the module docstring); without
        it, the grpc error is raised. Ends when the consumer stops iterating (or, without
        reconnect, when the registry shuts down)."""
        known: dict[str, bootstrap_pb2.WorkerInfo] = {}
        backoff_s = min_backoff_s
        while True:
            snapshot: dict[str, bootstrap_pb2.WorkerInfo] | None = {}  # None once SYNCED
            # With several registries, do not wait on one that is down: fail, and try the next.
            call = self._stub.Watch(bootstrap_pb2.WatchRequest(role=role, model=model),
                                    wait_for_ready=len(self.addresses) == 1)
            try:
                async for event in call:
                    if snapshot is not None and event.type != _SYNCED:
                        _apply(snapshot, event)
                        continue
                    if snapshot is not None:
                        for change in _reconcile(known, snapshot):
                            yield change
                        snapshot, backoff_s = None, min_backoff_s
                        yield event
                        continue
                    _apply(known, event)
                    yield event
                if not reconnect:
                    return
                log.warning("registry %s ended the watch stream; watching again", self.address)
            except grpc.aio.AioRpcError as exc:
                if not reconnect:
                    raise
                log.warning("watch on registry %s failed: %s %s; retrying in %.1fs", self.address,
                            exc.code().name, exc.details(), backoff_s)
                if exc.code() in _FAILOVER_CODES:
                    self._fail_over()
            finally:
                call.cancel()
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, max_backoff_s)


def _apply(workers: dict[str, bootstrap_pb2.WorkerInfo], event: bootstrap_pb2.WorkerEvent) -> None:
    if event.type in (_JOINED, _UPDATED):
        workers[event.worker.worker_id] = event.worker
    elif event.type == _LEFT:
        workers.pop(event.worker.worker_id, None)


def _reconcile(known: dict[str, bootstrap_pb2.WorkerInfo], snapshot: dict[str, bootstrap_pb2.WorkerInfo]
               ) -> list[bootstrap_pb2.WorkerEvent]:
    """Events that turn `known` into `snapshot`; `known` is updated in place."""
    changes = [bootstrap_pb2.WorkerEvent(type=_LEFT, worker=info, reason=REASON_UNREACHABLE)
               for worker_id, info in known.items() if worker_id not in snapshot]
    for worker_id, info in snapshot.items():
        if worker_id not in known:
            changes.append(bootstrap_pb2.WorkerEvent(type=_JOINED, worker=info))
        elif known[worker_id] != info:
            changes.append(bootstrap_pb2.WorkerEvent(type=_UPDATED, worker=info))
    known.clear()
    known.update(snapshot)
    return changes
