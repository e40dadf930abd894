"""RegistryClient against the real Bootstrap servicer on an in-process gRPC server (127.0.0.1:0)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from protos.v1 import bootstrap_pb2, bootstrap_pb2_grpc, common_pb2
from services.bootstrap.registry import Registry
from services.bootstrap.servicer import BootstrapServicer
from services.common.grpc_server import GrpcServer, ServiceBinding, service_name, start_grpc_server
from services.common.registry_client import REASON_UNREACHABLE, RegistryClient
from tests.services.bootstrap.workers import worker_info

pytestmark = pytest.mark.timeout(60)

JOINED = bootstrap_pb2.WORKER_EVENT_TYPE_JOINED
UPDATED = bootstrap_pb2.WORKER_EVENT_TYPE_UPDATED
LEFT = bootstrap_pb2.WORKER_EVENT_TYPE_LEFT
SYNCED = bootstrap_pb2.WORKER_EVENT_TYPE_SYNCED


@dataclass
class RunningRegistry:
    registry: Registry
    server: GrpcServer

    async def stop(self) -> None:
        await self.registry.close()
        await self.server.stop(0)


async def start_registry(port: int = 0, instance: str = "r", interval_s: float = 0.1,
                         max_failure: int = 3) -> RunningRegistry:
    registry = Registry(interval_s, max_failure, instance=instance)
    await registry.start()
    server = await start_grpc_server(
        [ServiceBinding(service_name(bootstrap_pb2, "Bootstrap"), BootstrapServicer(registry),
                        bootstrap_pb2_grpc.add_BootstrapServicer_to_server)], "127.0.0.1", port)
    return RunningRegistry(registry, server)


@pytest.fixture
async def running() -> AsyncIterator[RunningRegistry]:
    running = await start_registry()
    yield running
    await running.stop()


async def next_event(events: AsyncIterator[bootstrap_pb2.WorkerEvent], timeout: float = 5.0):
    return await asyncio.wait_for(events.__anext__(), timeout)


async def test_register_heartbeat_deregister() -> None:
    running = await start_registry(interval_s=0.1, max_failure=5)  # 5 missed beats of slack on a busy box
    async with RegistryClient(running.server.address) as client:
        lease = await client.register(worker_info())
        assert client.worker_id == "prefill-r-1"
        assert lease.heartbeat_interval_seconds == pytest.approx(0.1)
        assert lease.ttl_seconds == pytest.approx(0.5)
        client.start_heartbeat(load=lambda: common_pb2.WorkerLoad(running=4, total_pages=10))
        await asyncio.sleep(1.5)  # 3 lease lifetimes: alive only because heartbeats run
        [listed] = await client.list()
        assert (listed.worker_id, listed.load.running) == ("prefill-r-1", 4)
    assert running.registry.list() == []  # close() deregistered
    await running.stop()


async def test_status_codes(running: RunningRegistry) -> None:
    async with RegistryClient(running.server.address) as client:
        await client.register(worker_info("127.0.0.1:5000", page_size=16))
        other = RegistryClient(running.server.address)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await other.register(worker_info("127.0.0.1:5001", page_size=32))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "page_size: 32 vs 16" in refused.value.details()
        bad = worker_info("127.0.0.1:5002")
        bad.ClearField("model")
        with pytest.raises(grpc.aio.AioRpcError) as invalid:
            await other.register(bad)
        assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        stub = bootstrap_pb2_grpc.BootstrapStub(client._channel)
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await stub.Heartbeat(bootstrap_pb2.HeartbeatRequest(lease_id="nope"))
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        await other.close()


async def test_heartbeat_reregisters_after_expiry(running: RunningRegistry) -> None:
    registered: list[str] = []
    async with RegistryClient(running.server.address, on_registered=registered.append) as client:
        await client.register(worker_info())
        while running.registry.list():  # no heartbeats: the lease (0.3 s) expires
            await asyncio.sleep(0.05)
        await client.heartbeat()  # NOT_FOUND -> registers again
        assert registered == ["prefill-r-1", "prefill-r-2"]
        assert [w.worker_id for w in running.registry.list()] == ["prefill-r-2"]


async def test_watch_through_grpc(running: RunningRegistry) -> None:
    async with RegistryClient(running.server.address) as watcher_client, \
            RegistryClient(running.server.address) as worker:
        await worker.register(worker_info("127.0.0.1:5000"))
        events = watcher_client.watch(reconnect=False)
        event = await next_event(events)
        assert (event.type, event.worker.worker_id) == (JOINED, "prefill-r-1")
        assert (await next_event(events)).type == SYNCED
        await worker.deregister()
        event = await next_event(events)
        assert (event.type, event.worker.worker_id, event.reason) == (LEFT, "prefill-r-1", "deregistered")
        await events.aclose()
    await asyncio.sleep(0.1)
    assert running.registry.num_watchers == 0  # the server noticed the cancelled stream


async def test_watch_reconnects_and_reconciles() -> None:
    """The registry restarts on the same port with other workers: the watcher sees LEFT for the
    vanished worker, JOINED for the new one, and SYNCED, without its consumer resetting anything."""
    first = await start_registry(instance="a")
    port = first.server.port
    client = RegistryClient(first.server.address)
    gone = RegistryClient(first.server.address)
    await gone.register(worker_info("127.0.0.1:5000"))
    events = client.watch(min_backoff_s=0.05, max_backoff_s=0.2)
    assert (await next_event(events)).worker.worker_id == "prefill-a-1"
    assert (await next_event(events)).type == SYNCED

    await first.stop()
    second = await start_registry(port=port, instance="b", interval_s=5.0)
    try:
        newcomer = RegistryClient(second.server.address)
        await newcomer.register(worker_info("127.0.0.1:5001"))
        seen = [await next_event(events, timeout=10) for _ in range(3)]
        # The newcomer is in the new snapshot or arrives live after SYNCED, depending on timing.
        assert {(e.type, e.worker.worker_id, e.reason) for e in seen} == {
            (LEFT, "prefill-a-1", REASON_UNREACHABLE), (JOINED, "prefill-b-1", ""), (SYNCED, "", "")}
        assert seen[0].type == LEFT or seen[1].type == LEFT  # the reconciliation precedes SYNCED
        assert next(e for e in seen if e.type == JOINED).worker.grpc_address == "127.0.0.1:5001"
        await events.aclose()
        await newcomer.close()
        await gone.stop_heartbeat()
        await client.close()
        await gone._channel.close()
    finally:
        await second.stop()
