"""pdserve.v1.KvEvents over a real grpc.aio server and a real engine (tiny model): the snapshot,
the deltas, a subscriber that falls behind, and listeners removed when a stream ends."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from engine.sampling import SamplingParams
from pdserve.page_hash import page_hashes
from protos.v1 import worker_pb2, worker_pb2_grpc
from services.common.grpc_server import ServiceBinding, service_name, start_grpc_server
from services.worker.kv_events import KvEventsServicer
from tests.engine.conftest import generate, random_prompts, start_engine

PARAMS = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from tools.models.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path_factory.mktemp("kv-events") / "tiny", preset="tiny", seed=0)
    started = start_engine(model, num_pages=64, page_size=16)
    yield started
    started.shutdown()


async def serve(servicer: KvEventsServicer):
    return await start_grpc_server([ServiceBinding(service_name(worker_pb2, "KvEvents"), servicer,
                                                   worker_pb2_grpc.add_KvEventsServicer_to_server)],
                                   "127.0.0.1", 0)


async def run(engine, prompt, room):
    async for _ in generate(engine, prompt, PARAMS, room):
        pass


async def test_snapshot_then_stored_events_then_listener_removed(engine):
    servicer = KvEventsServicer(engine)
    server = await serve(servicer)
    (first, second) = random_prompts([40, 50], seed=7)
    await run(engine, first, "before")  # cached before anyone subscribes: in the snapshot
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stream = worker_pb2_grpc.KvEventsStub(channel).Subscribe(worker_pb2.KvEventsRequest())
            snapshot = await stream.read()
            assert snapshot.snapshot and snapshot.page_size == 16
            assert set(page_hashes(first, 16)) <= set(snapshot.events[0].page_hashes)
            await run(engine, second, "after")
            got: list[int] = []
            while len(got) < 3:
                batch = await asyncio.wait_for(stream.read(), 10)
                assert not batch.snapshot
                got += [h for e in batch.events if e.kind == worker_pb2.KV_EVENT_KIND_STORED
                        for h in e.page_hashes]
            assert got == page_hashes(second, 16)
            assert servicer.subscribers == 1 and len(engine.pages.cache.listeners) == 1
            stream.cancel()
        for _ in range(100):
            if not engine.pages.cache.listeners:
                break
            await asyncio.sleep(0.05)
        assert servicer.subscribers == 0 and engine.pages.cache.listeners == []
    finally:
        await server.stop(None)


async def test_a_subscriber_too_far_behind_is_told_to_subscribe_again(engine):
    server = await serve(KvEventsServicer(engine, max_pending=2))
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stream = worker_pb2_grpc.KvEventsStub(channel).Subscribe(worker_pb2.KvEventsRequest())
            assert (await stream.read()).snapshot
            await run(engine, random_prompts([64], seed=8)[0], "burst")  # 4 new pages > 2
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                while True:
                    await asyncio.wait_for(stream.read(), 10)
            assert failure.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "subscribe again" in failure.value.details()
    finally:
        await server.stop(None)
    assert engine.pages.cache.listeners == []
