"""Registry state: leases, expiry, watchers, the per-model consistency check (in-process, fast)."""

from __future__ import annotations

import asyncio

import pytest

from protos.v1 import bootstrap_pb2, common_pb2
from services.bootstrap.registry import InvalidWorker, LeaseNotFound, RegistrationRefused, Registry
from services.bootstrap.watchers import WatcherOverflow
from tests.services.bootstrap.workers import worker_info

pytestmark = pytest.mark.timeout(60)

JOINED = bootstrap_pb2.WORKER_EVENT_TYPE_JOINED
UPDATED = bootstrap_pb2.WORKER_EVENT_TYPE_UPDATED
LEFT = bootstrap_pb2.WORKER_EVENT_TYPE_LEFT
SYNCED = bootstrap_pb2.WORKER_EVENT_TYPE_SYNCED
PREFILL = common_pb2.WORKER_ROLE_PREFILL
DECODE = common_pb2.WORKER_ROLE_DECODE


class FakeClock:
    """A settable monotonic clock so expiry tests do not depend on sleeping."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def registry(clock: FakeClock) -> Registry:
    return Registry(heartbeat_interval_s=1.0, heartbeat_max_failure=3, clock=clock, instance="r")


async def next_event(watcher, timeout: float = 2.0) -> bootstrap_pb2.WorkerEvent:
    return await asyncio.wait_for(watcher.__anext__(), timeout)


def test_register_assigns_ids_and_lease(registry: Registry) -> None:
    prefill_id, lease = registry.register(worker_info("127.0.0.1:5000", PREFILL))
    decode_id, lease2 = registry.register(worker_info("127.0.0.1:5001", DECODE))
    assert (prefill_id, decode_id) == ("prefill-r-1", "decode-r-2")
    assert lease.ttl_seconds == 3.0 and lease.heartbeat_interval_seconds == 1.0
    assert lease.lease_id and lease.lease_id != lease2.lease_id
    assert [w.worker_id for w in registry.list()] == ["prefill-r-1", "decode-r-2"]
    assert [w.worker_id for w in registry.list(role=DECODE)] == ["decode-r-2"]
    assert registry.list(model="other") == []
    listed = registry.list(role=PREFILL)[0]
    assert listed.grpc_address == "127.0.0.1:5000" and listed.transfer_endpoint.descriptor == b"\x00opaque"
    assert registry.count_by_role() == {"prefill": 1, "decode": 1, "colocated": 0}


def test_list_returns_copies(registry: Registry) -> None:
    registry.register(worker_info())
    registry.list()[0].model = "changed"
    assert registry.list()[0].model == "tiny"


def test_heartbeat_renews_lease_and_records_load(registry: Registry, clock: FakeClock) -> None:
    _, lease = registry.register(worker_info())
    clock.now += 2.5
    registry.heartbeat(lease.lease_id, common_pb2.WorkerLoad(running=3, free_pages=7, total_pages=10))
    clock.now += 2.5  # 5 s after registering, 2.5 s after the heartbeat: alive
    assert registry.expire() == []
    assert registry.list()[0].load.running == 3
    clock.now += 0.5  # 3 s after the heartbeat: gone
    assert registry.expire() == ["prefill-r-1"]
    assert registry.list() == []
    assert registry.stats.lease_expiries == 1
    with pytest.raises(LeaseNotFound, match="register again"):
        registry.heartbeat(lease.lease_id)


def test_deregister(registry: Registry) -> None:
    _, lease = registry.register(worker_info())
    assert registry.deregister(lease.lease_id) == "prefill-r-1"
    assert registry.list() == []
    with pytest.raises(LeaseNotFound):
        registry.deregister(lease.lease_id)


async def test_watch_snapshot_then_changes(registry: Registry, clock: FakeClock) -> None:
    _, lease = registry.register(worker_info("127.0.0.1:5000", PREFILL))
    watcher = registry.watch()
    event = await next_event(watcher)
    assert (event.type, event.worker.worker_id) == (JOINED, "prefill-r-1")
    assert (await next_event(watcher)).type == SYNCED

    _, decode_lease = registry.register(worker_info("127.0.0.1:5001", DECODE))
    event = await next_event(watcher)
    assert (event.type, event.worker.worker_id, event.worker.role) == (JOINED, "decode-r-2", DECODE)

    registry.heartbeat(lease.lease_id, common_pb2.WorkerLoad(waiting=2))
    registry.heartbeat(lease.lease_id, common_pb2.WorkerLoad(waiting=2))  # unchanged: no event
    registry.heartbeat(decode_lease.lease_id, common_pb2.WorkerLoad(running=1))
    event = await next_event(watcher)
    assert (event.type, event.worker.worker_id, event.worker.load.waiting) == (UPDATED, "prefill-r-1", 2)
    event = await next_event(watcher)
    assert (event.type, event.worker.worker_id, event.worker.load.running) == (UPDATED, "decode-r-2", 1)

    registry.deregister(decode_lease.lease_id)
    event = await next_event(watcher)
    assert (event.type, event.worker.worker_id, event.reason) == (LEFT, "decode-r-2", "deregistered")

    clock.now += 10
    registry.expire()
    event = await next_event(watcher)
    assert (event.type, event.worker.worker_id, event.reason) == (LEFT, "prefill-r-1", "lease expired")
    watcher.close()
    assert registry.num_watchers == 0


async def test_watch_filters_by_role_and_model(registry: Registry) -> None:
    watcher = registry.watch(role=DECODE, model="tiny")
    assert (await next_event(watcher)).type == SYNCED
    registry.register(worker_info("127.0.0.1:5000", PREFILL))
    registry.register(worker_info("127.0.0.1:5001", DECODE, model="other"))
    registry.register(worker_info("127.0.0.1:5002", DECODE))
    event = await next_event(watcher)
    assert (event.type, event.worker.grpc_address) == (JOINED, "127.0.0.1:5002")


async def test_expiry_task_sends_left_to_watchers() -> None:
    """Real time, tiny TTL (0.1 s x 5): a worker that stops heartbeating is expired by the task."""
    registry = Registry(heartbeat_interval_s=0.1, heartbeat_max_failure=5, instance="r")
    await registry.start()
    try:
        _, lease = registry.register(worker_info())
        watcher = registry.watch()
        assert (await next_event(watcher)).type == JOINED
        assert (await next_event(watcher)).type == SYNCED
        for _ in range(10):  # heartbeats keep it alive well past one TTL
            await asyncio.sleep(0.1)
            registry.heartbeat(lease.lease_id)
        assert [w.worker_id for w in registry.list()] == ["prefill-r-1"]
        event = await next_event(watcher, timeout=5.0)  # then it stops heartbeating
        assert (event.type, event.worker.worker_id, event.reason) == (LEFT, "prefill-r-1", "lease expired")
        assert registry.list() == []
    finally:
        await registry.close()


def test_layout_mismatch_refused_naming_both_values(registry: Registry) -> None:
    registry.register(worker_info("127.0.0.1:5000", PREFILL, page_size=16))
    with pytest.raises(RegistrationRefused) as refused:
        registry.register(worker_info("127.0.0.1:5001", DECODE, page_size=32, dtype="bfloat16"))
    message = str(refused.value)
    assert "KV layout mismatch for model 'tiny'" in message
    assert "page_size: 32 vs 16" in message and "dtype: bfloat16 vs float32" in message
    assert "127.0.0.1:5001" in message and "prefill-r-1 at 127.0.0.1:5000" in message
    assert [w.worker_id for w in registry.list()] == ["prefill-r-1"]
    # another model may use another layout
    registry.register(worker_info("127.0.0.1:5002", DECODE, model="big", page_size=32))
    assert registry.stats.registrations_refused["layout_mismatch"] == 1


def test_backend_mismatch_refused(registry: Registry) -> None:
    registry.register(worker_info("127.0.0.1:5000", PREFILL, backend="mooncake"))
    with pytest.raises(RegistrationRefused,
                       match="transfer backend mismatch for model 'tiny': nixl vs mooncake"):
        registry.register(worker_info("127.0.0.1:5001", DECODE, backend="nixl"))
    assert registry.stats.registrations_refused["backend_mismatch"] == 1


def test_encoders_agree_among_themselves_only(registry: Registry) -> None:
    """EPD: an encoder's layout is an embedding page and its backend the embeddings' one, so it is
    compared with the model's other encoders, never with its KV workers."""
    encoder = common_pb2.WORKER_ROLE_ENCODER
    registry.register(worker_info("127.0.0.1:5000", PREFILL, backend="mooncake", page_size=16))
    registry.register(worker_info("127.0.0.1:5001", encoder, backend="nixl", page_size=16, num_layers=1))
    with pytest.raises(RegistrationRefused, match="num_layers: 2 vs 1"):
        registry.register(worker_info("127.0.0.1:5002", encoder, backend="nixl", page_size=16))
    assert [w.worker_id for w in registry.list(role=encoder)] == ["encoder-r-2"]
    assert registry.count_by_role() == {"prefill": 1, "decode": 0, "colocated": 0, "encoder": 1}


@pytest.mark.parametrize(("mutate", "problem"), [
    (lambda w: w.ClearField("role"), "role is unspecified"),
    (lambda w: w.ClearField("model"), "model is empty"),
    (lambda w: setattr(w, "grpc_address", "nohost"), "is not host:port"),
    (lambda w: w.ClearField("kv_layout"), "kv_layout is missing"),
    (lambda w: setattr(w.kv_layout, "page_size", 0), "kv_layout.page_size must be positive"),
    (lambda w: w.ClearField("transfer_endpoint"), "a prefill worker needs a transfer_endpoint"),
    (lambda w: setattr(w.transfer_endpoint.layout, "page_size", 8), "transfer_endpoint.layout differs"),
])
def test_invalid_registration(registry: Registry, mutate, problem: str) -> None:
    worker = worker_info()
    mutate(worker)
    with pytest.raises(InvalidWorker, match=problem):
        registry.register(worker)
    assert registry.list() == [] and registry.stats.registrations_refused["invalid"] == 1


def test_colocated_needs_no_transfer_endpoint(registry: Registry) -> None:
    worker = worker_info(role=common_pb2.WORKER_ROLE_COLOCATED)
    worker.ClearField("transfer_endpoint")
    assert registry.register(worker)[0] == "colocated-r-1"


async def test_reregister_same_address_replaces(registry: Registry) -> None:
    _, old_lease = registry.register(worker_info("127.0.0.1:5000", PREFILL))
    watcher = registry.watch()
    assert [(await next_event(watcher)).type for _ in range(2)] == [JOINED, SYNCED]
    # the restarted worker may even change its layout: the entry it replaces is not a peer
    new_id, new_lease = registry.register(worker_info("127.0.0.1:5000", PREFILL, page_size=32))
    assert new_id == "prefill-r-2"
    event = await next_event(watcher)
    assert (event.type, event.worker.worker_id, event.reason) == (LEFT, "prefill-r-1", "replaced")
    event = await next_event(watcher)
    assert (event.type, event.worker.worker_id) == (JOINED, "prefill-r-2")
    assert [w.worker_id for w in registry.list()] == ["prefill-r-2"]
    with pytest.raises(LeaseNotFound):
        registry.heartbeat(old_lease.lease_id)
    registry.heartbeat(new_lease.lease_id)


async def test_slow_watcher_dropped_without_blocking_others(clock: FakeClock) -> None:
    registry = Registry(heartbeat_interval_s=1.0, heartbeat_max_failure=3, watcher_max_queued=3, clock=clock)
    slow = registry.watch()
    fast = registry.watch()
    assert (await next_event(fast)).type == SYNCED
    for port in range(5000, 5005):
        registry.register(worker_info(f"127.0.0.1:{port}"))
        assert (await next_event(fast)).type == JOINED
    assert registry.stats.watchers_dropped == 1 and registry.num_watchers == 1
    with pytest.raises(WatcherOverflow):
        await next_event(slow)


async def test_close_ends_watches(registry: Registry) -> None:
    watcher = registry.watch()
    assert (await next_event(watcher)).type == SYNCED
    await registry.close()
    with pytest.raises(StopAsyncIteration):
        await next_event(watcher)
    late = registry.watch()
    assert (await next_event(late)).type == SYNCED
    with pytest.raises(StopAsyncIteration):
        await next_event(late)
