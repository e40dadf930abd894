"""start_grpc_server: port 0, health checking, reflection, graceful stop, bind failure."""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from protos.v1 import bootstrap_pb2, bootstrap_pb2_grpc
from services.bootstrap.registry import Registry
from services.bootstrap.servicer import BootstrapServicer
from services.common.grpc_server import ServiceBinding, ShutdownSignals, service_name, start_grpc_server

pytestmark = pytest.mark.timeout(60)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def bootstrap_binding() -> ServiceBinding:
    return ServiceBinding(service_name(bootstrap_pb2, "Bootstrap"), BootstrapServicer(Registry(1.0, 2)),
                          bootstrap_pb2_grpc.add_BootstrapServicer_to_server)


def reflect(address: str, symbol: str) -> tuple[list[str], str]:
    with grpc.insecure_channel(address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        return list(database.get_services()), database.FindFileContainingSymbol(symbol).name


def test_service_name() -> None:
    assert service_name(bootstrap_pb2, "Bootstrap") == "pdserve.v1.Bootstrap"


async def test_health_and_reflection() -> None:
    server = await start_grpc_server([bootstrap_binding()], "127.0.0.1", 0)
    try:
        assert server.port > 0 and server.address == f"127.0.0.1:{server.port}"
        async with grpc.aio.insecure_channel(server.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", "pdserve.v1.Bootstrap"):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                assert reply.status == SERVING
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await health.Check(health_pb2.HealthCheckRequest(service="no.Such"), timeout=5)
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        # Reflection answers without the .proto files. Its client is synchronous: run it in a thread
        # so this event loop (which runs the server) stays free to answer.
        services, filename = await asyncio.to_thread(reflect, server.address, "pdserve.v1.WorkerInfo")
        assert set(services) >= {"pdserve.v1.Bootstrap", "grpc.health.v1.Health"}
        assert filename == "protos/v1/bootstrap.proto"
    finally:
        await server.stop(0)


async def test_graceful_stop_reports_not_serving_first() -> None:
    server = await start_grpc_server([bootstrap_binding()], "127.0.0.1", 0)
    async with grpc.aio.insecure_channel(server.address) as channel:
        updates = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
        assert (await asyncio.wait_for(updates.read(), 5)).status == SERVING
        stopping = asyncio.create_task(server.stop(grace_s=2.0))
        assert (await asyncio.wait_for(updates.read(), 5)).status == NOT_SERVING
        updates.cancel()
        await asyncio.wait_for(stopping, 10)


async def test_bind_failure_raises_oserror() -> None:
    first = await start_grpc_server([], "127.0.0.1", 0)
    try:
        with pytest.raises(OSError, match=f"127.0.0.1:{first.port}"):
            await start_grpc_server([], "127.0.0.1", first.port)
    finally:
        await first.stop(0)


async def test_shutdown_signals_caught_from_creation() -> None:
    # SIGUSR1 rather than SIGINT/SIGTERM: a mistake here must not take the test runner down.
    shutdown = ShutdownSignals((signal.SIGUSR1,))
    os.kill(os.getpid(), signal.SIGUSR1)  # before anyone waits: must not be lost
    assert await asyncio.wait_for(shutdown.wait(), 5) == signal.SIGUSR1
