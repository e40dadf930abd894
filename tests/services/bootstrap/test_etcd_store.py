"""EtcdStore against a real etcd started by the test (free ports, temp dir): two stores on one etcd
stand for two registry processes. Skipped, saying why, only when no etcd binary is installed."""

from __future__ import annotations

import asyncio
import itertools
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.v1 import bootstrap_pb2, bootstrap_pb2_grpc, common_pb2, registry_store_pb2
from services.bootstrap.config import BootstrapConfig
from services.bootstrap.etcd_client import EtcdClient, parse_endpoints
from services.bootstrap.etcd_store import EtcdStore
from services.bootstrap.registry import LeaseNotFound, RegistrationRefused
from services.bootstrap.servicer import BootstrapServicer
from services.bootstrap.watchers import StoreUnavailable, WatcherOverflow
from services.common.grpc_server import ServiceBinding, service_name, start_grpc_server
from services.common.registry_client import RegistryClient
from tests.services.bootstrap.etcd import EtcdServer, run_etcd
from tests.services.bootstrap.process import start_bootstrap
from tests.services.bootstrap.workers import worker_info

pytestmark = pytest.mark.timeout(120)

JOINED = bootstrap_pb2.WORKER_EVENT_TYPE_JOINED
UPDATED = bootstrap_pb2.WORKER_EVENT_TYPE_UPDATED
LEFT = bootstrap_pb2.WORKER_EVENT_TYPE_LEFT
SYNCED = bootstrap_pb2.WORKER_EVENT_TYPE_SYNCED

_clusters = itertools.count()


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    with run_etcd(tmp_path_factory.mktemp("etcd")) as server:
        yield server


def new_store(etcd: EtcdServer, cluster: str, interval_s: float = 0.5, max_failure: int = 4) -> EtcdStore:
    return EtcdStore(EtcdClient(parse_endpoints(etcd.endpoint)), cluster=cluster,
                     heartbeat_interval_s=interval_s, heartbeat_max_failure=max_failure)


@pytest.fixture
async def stores(etcd: EtcdServer) -> AsyncIterator[tuple[EtcdStore, EtcdStore]]:
    """Two stores (two registry processes) on one etcd, in a cluster of this test's own."""
    cluster = f"t{next(_clusters)}"
    first, second = new_store(etcd, cluster), new_store(etcd, cluster)
    await first.start()
    await second.start()
    yield first, second
    await first.close()
    await second.close()


async def next_event(watcher, timeout: float = 10.0) -> bootstrap_pb2.WorkerEvent:
    return await asyncio.wait_for(watcher.__anext__(), timeout)


async def test_two_stores_share_workers_heartbeats_and_events(stores) -> None:
    first, second = stores
    watcher = second.watch()
    assert (await next_event(watcher)).type == SYNCED

    worker_id, lease = await first.register(worker_info("127.0.0.1:7001"))
    assert worker_id.startswith("prefill-") and lease.lease_id.startswith(worker_id + ":")
    assert lease.ttl_seconds == 2.0 and lease.heartbeat_interval_seconds == 0.5
    assert [w.worker_id for w in await second.list()] == [worker_id]
    event = await next_event(watcher)
    assert (event.type, event.worker.worker_id) == (JOINED, worker_id)

    # a heartbeat through the other process renews the same lease and publishes the load
    await second.heartbeat(lease.lease_id, common_pb2.WorkerLoad(running=3))
    event = await next_event(watcher)
    assert (event.type, event.worker.load.running) == (UPDATED, 3)
    await first.heartbeat(lease.lease_id, common_pb2.WorkerLoad(running=3))  # unchanged: no event
    # and the worker's LoRA adapters, when they change
    adapters = [common_pb2.LoraAdapterRef(name="a", cache_key="a@0f")]
    await first.heartbeat(lease.lease_id, common_pb2.WorkerLoad(running=3), adapters)
    event = await next_event(watcher)
    assert (event.type, list(event.worker.lora_adapters)) == (UPDATED, adapters)
    [listed] = await first.list(common_pb2.WORKER_ROLE_PREFILL, "tiny")
    assert listed.load.running == 3 and list(listed.lora_adapters) == adapters
    assert await first.list(common_pb2.WORKER_ROLE_DECODE) == [] and await first.list(model="other") == []

    # the same grpc_address registering again replaces the old entry, atomically
    new_id, new_lease = await second.register(worker_info("127.0.0.1:7001"))
    events = [await next_event(watcher) for _ in range(2)]
    assert [(e.type, e.worker.worker_id, e.reason) for e in events] == [
        (LEFT, worker_id, "replaced"), (JOINED, new_id, "")]
    with pytest.raises(LeaseNotFound):
        await first.heartbeat(lease.lease_id)

    assert await first.deregister(new_lease.lease_id) == new_id
    event = await next_event(watcher)
    assert (event.type, event.worker.worker_id, event.reason) == (LEFT, new_id, "deregistered")
    assert await second.list() == []
    with pytest.raises(LeaseNotFound):
        await second.deregister(new_lease.lease_id)
    assert first.count_by_role() == second.count_by_role() == {"prefill": 0, "decode": 0, "colocated": 0}
    watcher.close()


async def test_lease_expires_in_etcd_and_every_store_says_so(stores) -> None:
    first, second = stores
    watchers = [first.watch(), second.watch()]
    for watcher in watchers:
        assert (await next_event(watcher)).type == SYNCED
    worker_id, lease = await first.register(worker_info("127.0.0.1:7002", role=common_pb2.WORKER_ROLE_DECODE))
    for watcher in watchers:
        assert (await next_event(watcher)).type == JOINED
    assert first.count_by_role()["decode"] == 1
    # no heartbeats: etcd expires the 2 s lease, whichever registry process granted it
    for watcher in watchers:
        event = await next_event(watcher, timeout=15)
        assert (event.type, event.worker.worker_id, event.reason) == (LEFT, worker_id, "lease expired")
    assert first.stats.lease_expiries == second.stats.lease_expiries == 1
    with pytest.raises(LeaseNotFound):
        await second.heartbeat(lease.lease_id)
    for watcher in watchers:
        watcher.close()


async def test_a_new_watch_gets_a_snapshot_in_registration_order(stores) -> None:
    first, second = stores
    ids = [(await first.register(worker_info(f"127.0.0.1:{7010 + i}")))[0] for i in range(3)]
    for _ in range(100):  # the second store's etcd watch delivers them to its cache
        if second.count_by_role()["prefill"] == 3:
            break
        await asyncio.sleep(0.1)
    watcher = second.watch(common_pb2.WORKER_ROLE_PREFILL, "tiny")
    snapshot = [await next_event(watcher) for _ in range(4)]
    assert [(e.type, e.worker.worker_id) for e in snapshot] == [(JOINED, i) for i in ids] + [(SYNCED, "")]
    assert [w.worker_id for w in await second.list()] == ids
    watcher.close()


async def test_layout_agreement_holds_across_processes_under_racing_registrations(stores) -> None:
    first, second = stores
    for round_ in range(3):
        # 6 workers of one model with 3 different page sizes, registered at once through both stores
        attempts = [(first if i % 2 else second).register(
            worker_info(f"127.0.0.1:{7100 + 10 * round_ + i}", model=f"m{round_}", page_size=16 << (i % 3)))
            for i in range(6)]
        results = await asyncio.gather(*attempts, return_exceptions=True)
        admitted = [r for r in results if not isinstance(r, BaseException)]
        refused = [r for r in results if isinstance(r, RegistrationRefused)]
        assert len(admitted) + len(refused) == 6, results
        sizes = {w.kv_layout.page_size for w in await first.list(model=f"m{round_}")}
        assert len(sizes) == 1 and len(admitted) == 2, (sizes, results)
        assert all("page_size" in str(r) for r in refused)
    assert first.stats.registrations_refused["layout_mismatch"] + \
        second.stats.registrations_refused["layout_mismatch"] == 12


async def test_backend_mismatch_and_invalid_workers_are_refused(stores) -> None:
    first, second = stores
    await first.register(worker_info("127.0.0.1:7201", backend="mooncake"))
    with pytest.raises(RegistrationRefused, match="transfer backend mismatch"):
        await second.register(worker_info("127.0.0.1:7202", backend="nixl"))
    bad = worker_info("127.0.0.1:7203")
    bad.ClearField("model")
    with pytest.raises(ValueError, match="model is empty"):
        await second.register(bad)
    assert len(await second.list()) == 1


async def test_forged_records_and_malformed_keys_are_ignored(etcd: EtcdServer, stores) -> None:
    first, second = stores
    raw = EtcdClient(parse_endpoints(etcd.endpoint))
    prefix = first.prefix
    # watched from before the registration: a watch opened after it starts from the second store's
    # cache, which the registration reaches through etcd's watch some time later
    watcher = second.watch()
    assert (await next_event(watcher)).type == SYNCED
    good_id, good_lease = await first.register(worker_info("127.0.0.1:7301"))
    event = await next_event(watcher)
    assert (event.type, event.worker.worker_id) == (JOINED, good_id)

    def stored(worker_id: str, **changes) -> bytes:
        info = worker_info("127.0.0.1:7399")
        info.worker_id = worker_id
        for name, value in changes.items():
            setattr(info, name, value)
        return registry_store_pb2.StoredWorker(worker=info, lease_token="t").SerializeToString()

    forged = {
        prefix + b"prefill-1": b"\xff\xfe not a protobuf",
        prefix + b"PREFILL/../x": stored("PREFILL/../x"),
        prefix + b"prefill-2": stored("prefill-3"),  # names another worker
        prefix + b"prefill-4": stored("prefill-4", grpc_address="no-port"),  # fails validation
        prefix + b"prefill-5": registry_store_pb2.StoredWorker(worker=bootstrap_pb2.WorkerInfo(
            worker_id="prefill-5")).SerializeToString(),
        prefix + b"\x00\x01": b"",
    }
    for key, value in forged.items():
        await raw.put(key, value)
    # a record that is fine but overwrites a live worker with garbage takes it out of every view
    await raw.put(prefix + good_id.encode(), b"garbage")
    event = await next_event(watcher)
    assert (event.type, event.worker.worker_id, event.reason) == (LEFT, good_id, "record unreadable")
    assert await first.list() == [] and await second.list() == []
    with pytest.raises(LeaseNotFound):
        await first.heartbeat(good_lease.lease_id)

    # lease ids that are malformed, guessed or name a forged record are NOT_FOUND, not crashes
    for lease_id in ("", ":", "nope", "prefill-1:t", "prefill-2:t", f"{good_id}:wrong", "a:b:c",
                     "prefill-zz:t"):
        with pytest.raises(LeaseNotFound):
            await second.heartbeat(lease_id)
        with pytest.raises(LeaseNotFound):
            await second.deregister(lease_id)

    # a store started now skips the same records, and both still serve real workers
    third = new_store(etcd, first.cluster)
    await third.start()
    new_id, _ = await third.register(worker_info("127.0.0.1:7302"))
    assert [w.worker_id for w in await first.list()] == [new_id]
    event = await next_event(watcher)
    assert (event.type, event.worker.worker_id) == (JOINED, new_id)
    assert third.count_by_role()["prefill"] == 1
    watcher.close()
    await third.close()
    await raw.close()


async def test_a_watcher_that_falls_behind_is_dropped(etcd: EtcdServer) -> None:
    store = EtcdStore(EtcdClient(parse_endpoints(etcd.endpoint)), cluster=f"t{next(_clusters)}",
                      heartbeat_interval_s=5, heartbeat_max_failure=2, watcher_max_queued=2)
    await store.start()
    try:
        watcher = store.watch()
        for i in range(4):
            await store.register(worker_info(f"127.0.0.1:{7400 + i}"))
        await asyncio.sleep(0.5)
        with pytest.raises(WatcherOverflow):
            async for _ in watcher:
                pass
        assert store.stats.watchers_dropped == 1 and store.num_watchers == 0
    finally:
        await store.close()


async def test_unreachable_etcd_fails_start_with_its_address() -> None:
    store = EtcdStore(EtcdClient(["127.0.0.1:1"], timeout_s=0.5), cluster="x", heartbeat_interval_s=1,
                      heartbeat_max_failure=2, connect_timeout_s=1.0)
    with pytest.raises(ConnectionError, match="etcd at 127.0.0.1:1 unreachable"):
        await store.start()
    await store.close()


def test_config_checks_the_store_flags() -> None:
    assert parse_endpoints("http://127.0.0.1:2379, 10.0.0.2:2379/") == ["127.0.0.1:2379", "10.0.0.2:2379"]
    for bad in ("", "http://nohost", "https://127.0.0.1:2379", "127.0.0.1:port"):
        with pytest.raises(ValueError):
            parse_endpoints(bad)
    with pytest.raises(ValueError, match="registry_store must be memory or etcd"):
        BootstrapConfig(registry_store="zookeeper")
    with pytest.raises(ValueError, match="etcd_cluster"):
        BootstrapConfig(registry_store="etcd", etcd_cluster="a/b")
    with pytest.raises(ValueError, match="not \\[http://\\]host:port"):
        BootstrapConfig(registry_store="etcd", etcd_endpoints="http://localhost")


async def test_a_client_fails_over_between_registry_servers_keeping_its_lease(etcd: EtcdServer) -> None:
    """Two Bootstrap gRPC servers on two stores; the worker's client is given both. The first
    server stops: heartbeats go to the second, renewing the same lease; the worker keeps its id."""
    cluster = f"t{next(_clusters)}"
    servers, stores_ = [], []
    for _ in range(2):
        store = new_store(etcd, cluster, interval_s=0.3, max_failure=7)
        await store.start()
        stores_.append(store)
        servers.append(await start_grpc_server(
            [ServiceBinding(service_name(bootstrap_pb2, "Bootstrap"), BootstrapServicer(store),
                            bootstrap_pb2_grpc.add_BootstrapServicer_to_server)], "127.0.0.1", 0))
    registered: list[str] = []
    client = RegistryClient(",".join(server.address for server in servers), on_registered=registered.append)
    try:
        await client.register(worker_info("127.0.0.1:7501"))
        client.start_heartbeat(load=lambda: common_pb2.WorkerLoad(running=1))
        await servers[0].stop(0)
        await asyncio.sleep(4.5)  # two lease lifetimes (2.1 s -> 3 s) with the first server gone
        assert client.address == servers[1].address
        assert [w.worker_id for w in await stores_[1].list()] == registered  # the same, single id
        assert (await stores_[1].list())[0].load.running == 1
        assert stores_[1].stats.lease_expiries == 0
        unknown = bootstrap_pb2_grpc.BootstrapStub(client._channel)
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await unknown.Heartbeat(bootstrap_pb2.HeartbeatRequest(lease_id="prefill-1:forged"))
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await client.close()  # deregisters through the second server
        assert await stores_[1].list() == []
        await servers[1].stop(0)
        for store in stores_:
            await store.close()


async def test_a_store_that_loses_etcd_ends_its_watches_then_resumes(tmp_path: Path) -> None:
    """etcd goes away: the store can no longer vouch for its view, so its watches end with
    StoreUnavailable (UNAVAILABLE: clients move to another registry) and new ones are refused.
    etcd comes back on the same port and data: the store's watch resumes from the last revision it
    saw, so a worker registered meanwhile is in its view again."""
    (tmp_path / "a").mkdir()
    with run_etcd(tmp_path / "a") as etcd:
        store = new_store(etcd, "restart", interval_s=5, max_failure=2)
        await store.start()
        watcher = store.watch()
        assert (await next_event(watcher)).type == SYNCED
        etcd.proc.kill()
        etcd.proc.wait()
        with pytest.raises(StoreUnavailable, match="lost its etcd watch"):
            await next_event(watcher)
        with pytest.raises(StoreUnavailable):
            store.watch()
        with pytest.raises(StoreUnavailable, match="etcd unreachable"):
            await store.list()
        with run_etcd(tmp_path / "a", client_port=etcd.client_port, peer_port=etcd.peer_port) as again:
            writer = new_store(again, "restart", interval_s=5, max_failure=2)
            await writer.start()
            worker_id, _ = await writer.register(worker_info("127.0.0.1:7601"))
            event = None
            for _ in range(200):
                try:
                    watcher = store.watch()
                except StoreUnavailable:
                    await asyncio.sleep(0.1)
                    continue
                event = await next_event(watcher)
                if event.type == JOINED:
                    break
                assert event.type == SYNCED
                event = await next_event(watcher)  # registered after the watch resumed: arrives live
                break
            assert event is not None and (event.type, event.worker.worker_id) == (JOINED, worker_id)
            watcher.close()
            await writer.close()
            await store.close()


@pytest.mark.e2e
async def test_registry_process_reports_not_serving_while_etcd_is_gone(tmp_path: Path) -> None:
    """`pdserve bootstrap --registry-store etcd`: its gRPC health and pdserve:bootstrap_store_up say
    whether its view is current; etcd killed -> NOT_SERVING and 0, etcd back -> SERVING and 1."""
    (tmp_path / "a").mkdir()
    with run_etcd(tmp_path / "a") as etcd:
        registry = start_bootstrap("--registry-store", "etcd", "--etcd-endpoints", etcd.endpoint,
                                   "--etcd-cluster", "health")
        try:
            assert any("etcd store at" in line for line in registry.lines)
            channel = grpc.aio.insecure_channel(registry.address)
            health = health_pb2_grpc.HealthStub(channel)

            async def wait_for(status: int, up: float) -> None:
                for _ in range(300):
                    answer = await health.Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Bootstrap"))
                    if answer.status == status and store_up(registry.metrics_port) == up:
                        return
                    await asyncio.sleep(0.1)
                raise AssertionError(f"health never became {status} with store_up {up}")

            await wait_for(health_pb2.HealthCheckResponse.SERVING, 1.0)
            etcd.proc.kill()
            etcd.proc.wait()
            await wait_for(health_pb2.HealthCheckResponse.NOT_SERVING, 0.0)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await anext(aiter(bootstrap_pb2_grpc.BootstrapStub(channel).Watch(
                    bootstrap_pb2.WatchRequest())))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            with run_etcd(tmp_path / "a", client_port=etcd.client_port, peer_port=etcd.peer_port):
                await wait_for(health_pb2.HealthCheckResponse.SERVING, 1.0)
            await channel.close()
        finally:
            assert registry.stop() == 0


def store_up(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("pdserve:bootstrap_store_up "):
                return float(line.split()[1])
    raise AssertionError("no pdserve:bootstrap_store_up")
