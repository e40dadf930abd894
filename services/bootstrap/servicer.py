"""The Bootstrap gRPC servicer: maps pdserve.v1.Bootstrap RPCs onto the registry's store.

Errors become status codes with the registry's message: InvalidWorker -> INVALID_ARGUMENT,
RegistrationRefused -> FAILED_PRECONDITION, LeaseNotFound -> NOT_FOUND, a watcher that fell
behind -> RESOURCE_EXHAUSTED, a store that cannot reach etcd -> UNAVAILABLE (clients given several
registry addresses try the next one).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from protos.v1 import bootstrap_pb2, bootstrap_pb2_grpc, common_pb2
from services.bootstrap.registry import InvalidWorker, LeaseNotFound, RegistrationRefused, Registry
from services.bootstrap.store import MemoryStore, RegistryStore
from services.bootstrap.watchers import StoreUnavailable, WatcherOverflow


class BootstrapServicer(bootstrap_pb2_grpc.BootstrapServicer):
    """Serves the registry to workers (Register/Heartbeat/Deregister) and gateways (List/Watch)."""

    def __init__(self, store: RegistryStore | Registry) -> None:
        self._registry = MemoryStore(store) if isinstance(store, Registry) else store

    async def Register(self, request: bootstrap_pb2.RegisterRequest, context: grpc.aio.ServicerContext
                       ) -> bootstrap_pb2.RegisterResponse:
        try:
            worker_id, lease = await self._registry.register(request.worker)
        except InvalidWorker as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RegistrationRefused as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except StoreUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return bootstrap_pb2.RegisterResponse(worker_id=worker_id, lease=lease)

    async def Heartbeat(self, request: bootstrap_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
                        ) -> bootstrap_pb2.HeartbeatResponse:
        try:
            lease = await self._registry.heartbeat(request.lease_id,
                                                   request.load if request.HasField("load") else None,
                                                   request.lora_adapters)
        except LeaseNotFound as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except StoreUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return bootstrap_pb2.HeartbeatResponse(lease=lease)

    async def Deregister(self, request: bootstrap_pb2.DeregisterRequest, context: grpc.aio.ServicerContext
                         ) -> bootstrap_pb2.DeregisterResponse:
        try:
            await self._registry.deregister(request.lease_id)
        except LeaseNotFound as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except StoreUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return bootstrap_pb2.DeregisterResponse()

    async def List(self, request: bootstrap_pb2.ListRequest, context: grpc.aio.ServicerContext
                   ) -> bootstrap_pb2.ListResponse:
        await _check_role_filter(request.role, context)
        try:
            workers = await self._registry.list(request.role, request.model)
        except StoreUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return bootstrap_pb2.ListResponse(workers=workers)

    async def Watch(self, request: bootstrap_pb2.WatchRequest, context: grpc.aio.ServicerContext
                    ) -> AsyncIterator[bootstrap_pb2.WorkerEvent]:
        await _check_role_filter(request.role, context)
        try:
            watcher = self._registry.watch(request.role, request.model)
        except StoreUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        try:
            async for event in watcher:
                yield event
        except WatcherOverflow as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc}: watch again")
        except StoreUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        finally:
            watcher.close()


async def _check_role_filter(role: int, context: grpc.aio.ServicerContext) -> None:
    if role not in common_pb2.WorkerRole.values():
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"role {role} is not a known WorkerRole")
