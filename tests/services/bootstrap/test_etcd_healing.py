"""The registry on etcd heals by itself: etcd restarted (same data, or wiped) or a worker's etcd lease
revoked, every live worker is back in the registry within a few lease lifetimes, with no operator
step. Real etcd, a real Bootstrap gRPC server on an EtcdStore, and workers' RegistryClients that
register and heartbeat through it. Skipped, saying why, only when no etcd binary is installed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from protos.v1 import bootstrap_pb2, bootstrap_pb2_grpc
from services.bootstrap.etcd_client import EtcdClient, parse_endpoints
from services.bootstrap.etcd_store import EtcdStore
from services.bootstrap.servicer import BootstrapServicer
from services.bootstrap.watchers import StoreUnavailable
from services.common.grpc_server import GrpcServer, ServiceBinding, service_name, start_grpc_server
from services.common.registry_client import RegistryClient
from tests.services.bootstrap.etcd import EtcdServer, run_etcd
from tests.services.bootstrap.workers import worker_info

pytestmark = pytest.mark.timeout(120)

SYNCED = bootstrap_pb2.WORKER_EVENT_TYPE_SYNCED
ADDRESSES = ("127.0.0.1:7701", "127.0.0.1:7702")
# 0.3 s x 7 = a lease of 3 s (etcd's are whole seconds); every wait below is a multiple of it
INTERVAL_S, MAX_FAILURE = 0.3, 7
HEAL_S = 30.0


@dataclass
class Registry:
    store: EtcdStore
    server: GrpcServer
    workers: list[RegistryClient]


@asynccontextmanager
async def registry_with_workers(etcd: EtcdServer) -> AsyncIterator[Registry]:
    """A registry server on etcd and two workers registered through it, heartbeating."""
    store = EtcdStore(EtcdClient(parse_endpoints(etcd.endpoint)), cluster="heal",
                      heartbeat_interval_s=INTERVAL_S, heartbeat_max_failure=MAX_FAILURE)
    await store.start()
    server = await start_grpc_server(
        [ServiceBinding(service_name(bootstrap_pb2, "Bootstrap"), BootstrapServicer(store),
                        bootstrap_pb2_grpc.add_BootstrapServicer_to_server)], "127.0.0.1", 0)
    workers = []
    try:
        for address in ADDRESSES:
            client = RegistryClient(server.address, rpc_timeout_s=2.0)
            workers.append(client)
            await client.register(worker_info(address))
            client.start_heartbeat()
        yield Registry(store, server, workers)
    finally:
        for client in workers:
            await client.stop_heartbeat()
            await client.close()
        await server.stop(0)
        await store.close()


async def watched(store: EtcdStore) -> dict[str, str]:
    """worker id -> grpc address as a new watch on `store` sees them (its cache, not etcd)."""
    for _ in range(int(HEAL_S * 10)):
        try:
            watcher = store.watch()
            break
        except StoreUnavailable:  # its etcd watch is not back yet
            await asyncio.sleep(0.1)
    else:
        raise AssertionError("the store never followed etcd again")
    seen: dict[str, str] = {}
    try:
        async for event in watcher:
            if event.type == SYNCED:
                return seen
            seen[event.worker.worker_id] = event.worker.grpc_address
    finally:
        watcher.close()
    raise AssertionError("watch ended before SYNCED")


async def healed(registry: Registry) -> dict[str, str]:
    """Wait until etcd (List) and the store's watch cache both hold exactly the workers' current
    ids; return them. Fails after HEAL_S."""
    want: dict[str, str] = {}
    for _ in range(int(HEAL_S * 5)):
        want = {client.worker_id: address
                for client, address in zip(registry.workers, ADDRESSES, strict=True)}
        try:
            listed = {info.worker_id: info.grpc_address for info in await registry.store.list()}
        except StoreUnavailable:
            listed = {}
        if listed == want and await watched(registry.store) == want:
            return want
        await asyncio.sleep(0.2)
    raise AssertionError(f"registry never healed: want {want}, etcd has {listed}, "
                         f"the watch sees {await watched(registry.store)}")


def kill(etcd: EtcdServer) -> None:
    etcd.proc.kill()
    etcd.proc.wait()


async def test_etcd_restarted_on_its_data_keeps_every_worker(tmp_path: Path) -> None:
    """etcd killed and started again on the same data: leases survive it, so every worker is back
    under its own id, in etcd and in the registry's watch."""
    (tmp_path / "a").mkdir()
    with run_etcd(tmp_path / "a") as etcd:
        async with registry_with_workers(etcd) as registry:
            before = await healed(registry)
            kill(etcd)
            await asyncio.sleep(2 * INTERVAL_S)  # a few heartbeats fail meanwhile
            with run_etcd(tmp_path / "a", client_port=etcd.client_port, peer_port=etcd.peer_port):
                assert await healed(registry) == before


async def test_etcd_restarted_wiped_gets_every_worker_again(tmp_path: Path) -> None:
    """etcd killed and started with an empty data dir: the records and leases are gone, so each
    worker's next heartbeat is refused NOT_FOUND and it registers again (a new id), and the
    registry's watch (whose last revision is now in etcd's future) reads etcd afresh and sees them."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    with run_etcd(tmp_path / "a") as etcd:
        async with registry_with_workers(etcd) as registry:
            before = await healed(registry)
            # revisions well past those a wiped etcd reaches while the workers re-register
            for _ in range(50):
                await registry.store.client.put(b"/elsewhere/bump", b"x")
            kill(etcd)
            with run_etcd(tmp_path / "b", client_port=etcd.client_port, peer_port=etcd.peer_port):
                after = await healed(registry)
                assert set(after.values()) == set(before.values())
                assert not set(after) & set(before)  # registered anew


async def test_a_revoked_lease_makes_its_worker_register_again(tmp_path: Path) -> None:
    """A worker's etcd lease revoked behind the registry's back (etcdctl lease revoke): its record
    goes with it, the worker's next heartbeat is refused NOT_FOUND and it registers again; the
    other worker keeps its id."""
    (tmp_path / "a").mkdir()
    with run_etcd(tmp_path / "a") as etcd:
        async with registry_with_workers(etcd) as registry:
            before = await healed(registry)
            victim, other = registry.workers
            record = await registry.store.client.get(registry.store.prefix + victim.worker_id.encode())
            assert record is not None and record.lease
            admin = EtcdClient(parse_endpoints(etcd.endpoint))
            try:
                assert await admin.revoke(record.lease)
            finally:
                await admin.close()
            after = await healed(registry)
            assert victim.worker_id not in before and other.worker_id in before
            assert after[victim.worker_id] == ADDRESSES[0]
