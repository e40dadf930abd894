"""Each worker's LoRA adapters in the registry: registered with the worker, replaced by its
heartbeats (watchers get UPDATED only when they change), reported at once when they change, not at
the next heartbeat interval."""

from __future__ import annotations

import asyncio

from protos.v1 import bootstrap_pb2, common_pb2
from services.bootstrap.registry import Registry
from services.common.registry_client import RegistryClient
from tests.services.bootstrap.workers import worker_info
from tests.services.common.test_registry_client import UPDATED, next_event, start_registry


def refs(*names: str) -> list[common_pb2.LoraAdapterRef]:
    return [common_pb2.LoraAdapterRef(name=name, cache_key=f"{name}@0f") for name in names]


async def test_heartbeats_replace_the_adapters_and_tell_watchers() -> None:
    registry = Registry(heartbeat_interval_s=1.0, heartbeat_max_failure=3, instance="r")
    info = worker_info()
    info.lora_adapters.extend(refs("a"))
    _, lease = registry.register(info)
    watcher = registry.watch()
    assert [a.name for a in (await next_event(watcher)).worker.lora_adapters] == ["a"]  # the snapshot
    await next_event(watcher)  # SYNCED
    registry.heartbeat(lease.lease_id, None, refs("a"))  # unchanged: no event
    registry.heartbeat(lease.lease_id, None, refs("a", "b"))
    event = await next_event(watcher)
    assert event.type == UPDATED and list(event.worker.lora_adapters) == refs("a", "b")
    registry.heartbeat(lease.lease_id, None, ())  # every adapter unloaded
    assert list((await next_event(watcher)).worker.lora_adapters) == []
    assert list(registry.list()[0].lora_adapters) == []
    watcher.close()


async def test_a_change_is_reported_at_once() -> None:
    # heartbeats every 30 s: only report_now can bring the change within the test
    running = await start_registry(interval_s=30.0, max_failure=2)
    served = refs("a")
    async with RegistryClient(running.server.address) as watching, \
            RegistryClient(running.server.address) as worker:
        info = worker_info()
        info.lora_adapters.extend(served)
        await worker.register(info)
        worker.start_heartbeat(load=lambda: common_pb2.WorkerLoad(total_pages=8),
                               lora_adapters=lambda: list(served))
        events = watching.watch(reconnect=False)
        assert [a.name for a in (await next_event(events)).worker.lora_adapters] == ["a"]
        assert (await next_event(events)).type == bootstrap_pb2.WORKER_EVENT_TYPE_SYNCED
        served.extend(refs("late"))
        worker.report_now()
        event = await asyncio.wait_for(next_event(events), 5.0)
        assert event.type == UPDATED and [a.name for a in event.worker.lora_adapters] == ["a", "late"]
        assert event.worker.lora_adapters[1].cache_key == "late@0f"
        # registering again (the registry forgot the worker) sends what it serves now
        assert worker.lease is not None
        running.registry.deregister(worker.lease.lease_id)
        served.pop(0)
        await worker.heartbeat()  # NOT_FOUND: registers again
        assert [a.name for a in running.registry.list()[0].lora_adapters] == ["late"]
        await events.aclose()
    await running.stop()
