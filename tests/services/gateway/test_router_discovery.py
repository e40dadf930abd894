"""Router candidate rules and Route accounting; registry events applied to the worker pool."""

from __future__ import annotations

import pytest

from protos.v1 import bootstrap_pb2, common_pb2
from services.gateway.discovery import RegistryDiscovery
from services.gateway.policies import RoundRobinPolicy
from services.gateway.workers import BreakerState, CircuitBreaker, NoWorkersError, Router, WorkerPool


def make_router(pool: WorkerPool) -> Router:
    return Router(pool, RoundRobinPolicy(), RoundRobinPolicy())


def test_decode_needs_a_prefill_colocated_does_not() -> None:
    pool = WorkerPool()
    pool.add("127.0.0.1:1", "decode", "m")
    router = make_router(pool)
    with pytest.raises(NoWorkersError, match="no healthy prefill worker") as info:
        router.pick("m", [1, 2])
    assert info.value.status == 503
    pool.add("127.0.0.1:2", "colocated", "m")
    route = router.pick("m", [1, 2])
    assert route.decode.address == "127.0.0.1:2" and route.prefill is None
    pool.add("127.0.0.1:3", "prefill", "m")
    routes = [router.pick("m", [1]) for _ in range(2)]
    assert {r.decode.address for r in routes} == {"127.0.0.1:1", "127.0.0.1:2"}
    pd = next(r for r in routes if r.decode.role == "decode")
    assert pd.prefill is not None and pd.prefill.address == "127.0.0.1:3"


def test_a_decode_that_prefills_locally_is_routed_without_a_prefill() -> None:
    pool = WorkerPool()
    pool.add("127.0.0.1:1", "decode", "m", local_prefill=True)
    route = make_router(pool).pick("m", [1, 2])
    assert route.decode.address == "127.0.0.1:1" and route.prefill is None
    pool.add("127.0.0.1:2", "prefill", "m")  # once a prefill is up, the decode gets one again
    route = make_router(pool).pick("m", [1, 2])
    assert route.prefill is not None and route.prefill.address == "127.0.0.1:2"


def test_unknown_model_and_excluded_workers() -> None:
    pool = WorkerPool()
    pool.add("127.0.0.1:1", "colocated", "m")
    router = make_router(pool)
    with pytest.raises(NoWorkersError, match="no workers serve model 'other'"):
        router.pick("other", [1])
    with pytest.raises(NoWorkersError, match="failed this request"):
        router.pick("m", [1], exclude={"127.0.0.1:1"})


def test_route_counts_inflight_and_charges_the_blamed_worker() -> None:
    pool = WorkerPool(lambda: CircuitBreaker(failure_threshold=1, cooldown_s=60))
    decode = pool.add("127.0.0.1:1", "decode", "m")
    prefill_a = pool.add("127.0.0.1:2", "prefill", "m")
    prefill_b = pool.add("127.0.0.1:3", "prefill", "m")
    router = make_router(pool)
    route = router.pick("m", [1])
    assert route.prefill is prefill_a and decode.inflight == 1 and prefill_a.inflight == 1
    route.finish(failed=[prefill_a])
    route.finish(failed=[decode])  # a second finish is ignored
    assert decode.inflight == 0 and prefill_a.inflight == 0
    assert prefill_a.breaker.state is BreakerState.OPEN and decode.breaker.state is BreakerState.CLOSED
    # the open prefill is no candidate any more
    assert all(router.pick("m", [1]).prefill is prefill_b for _ in range(3))


def test_half_open_worker_takes_one_trial_at_a_time() -> None:
    now = [0.0]
    pool = WorkerPool(lambda: CircuitBreaker(failure_threshold=1, cooldown_s=1, clock=lambda: now[0]))
    worker = pool.add("127.0.0.1:1", "colocated", "m")
    router = make_router(pool)
    router.pick("m", [1]).finish(failed=[worker])
    with pytest.raises(NoWorkersError, match="unhealthy"):
        router.pick("m", [1])
    now[0] = 1.0
    trial = router.pick("m", [1])
    with pytest.raises(NoWorkersError):
        router.pick("m", [1])  # the trial is in flight
    trial.finish(succeeded=True)
    assert worker.breaker.state is BreakerState.CLOSED
    router.pick("m", [1]).finish(succeeded=True)


def _event(kind: int, address: str, worker_id: str, role: int = common_pb2.WORKER_ROLE_DECODE,
           model: str = "m", reason: str = "", running: int = 0) -> bootstrap_pb2.WorkerEvent:
    info = bootstrap_pb2.WorkerInfo(worker_id=worker_id, role=role, model=model, grpc_address=address,
                                    load=common_pb2.WorkerLoad(running=running, waiting=2))
    return bootstrap_pb2.WorkerEvent(type=kind, worker=info, reason=reason)


def test_registry_events_update_the_pool() -> None:
    pool = WorkerPool()
    pool.add("127.0.0.1:9", "prefill", "m", static=True)
    discovery = RegistryDiscovery(pool, "127.0.0.1:1", "m")
    joined, updated, left = (bootstrap_pb2.WORKER_EVENT_TYPE_JOINED, bootstrap_pb2.WORKER_EVENT_TYPE_UPDATED,
                             bootstrap_pb2.WORKER_EVENT_TYPE_LEFT)
    discovery.apply(_event(joined, "127.0.0.1:5", "w-1"))
    discovery.apply(_event(joined, "127.0.0.1:6", "w-2", role=common_pb2.WORKER_ROLE_PREFILL))
    discovery.apply(_event(joined, "127.0.0.1:7", "w-3", model="other"))  # another model: ignored
    discovery.apply(bootstrap_pb2.WorkerEvent(type=bootstrap_pb2.WORKER_EVENT_TYPE_SYNCED))
    assert discovery.synced.is_set()
    assert [(w.role, w.address) for w in pool.all()] == [
        ("decode", "127.0.0.1:5"), ("prefill", "127.0.0.1:6"), ("prefill", "127.0.0.1:9")]
    discovery.apply(_event(updated, "127.0.0.1:5", "w-1", running=3))
    decode = pool.get("127.0.0.1:5")
    assert decode is not None and decode.reported.running == 3 and decode.reported.queued == 2
    # restarted on the same address: the new process replaces the old, and the old LEFT is ignored
    discovery.apply(_event(joined, "127.0.0.1:5", "w-4"))
    discovery.apply(_event(left, "127.0.0.1:5", "w-1", reason="replaced"))
    replaced = pool.get("127.0.0.1:5")
    assert replaced is not None and replaced.worker_id == "w-4" and replaced is not decode
    discovery.apply(_event(left, "127.0.0.1:5", "w-4", reason="lease expired"))
    discovery.apply(_event(left, "127.0.0.1:9", "w-9", role=common_pb2.WORKER_ROLE_PREFILL))  # static stays
    assert [w.address for w in pool.all()] == ["127.0.0.1:6", "127.0.0.1:9"]
