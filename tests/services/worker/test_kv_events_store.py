"""KV events name the tier: over a real grpc.aio server, real engines (tiny model) with the store tier
and a real mooncake_master, pages a worker writes through or fetches are published with medium
STORE (its own pool's with medium DEVICE, as before), the batches name the store, the store going
down removes every STORE page, and a stream that ends unhooks its listener from the tier."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from engine.sampling import SamplingParams
from pdserve.page_hash import page_hashes
from protos.v1 import worker_pb2, worker_pb2_grpc
from services.worker.kv_events import KvEventsServicer
from tests.engine.conftest import generate, random_prompts, start_engine
from tests.engine.test_hicache import MASTER, Master, wait_for
from tests.services.worker.test_kv_events import serve

pytestmark = pytest.mark.skipif(not MASTER.exists(),
                                reason="mooncake_master (the Mooncake wheel) is not installed")

PAGE = 16
PARAMS = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)
STORED, REMOVED = worker_pb2.KV_EVENT_KIND_STORED, worker_pb2.KV_EVENT_KIND_REMOVED
DEVICE, STORE = worker_pb2.KV_MEDIUM_DEVICE, worker_pb2.KV_MEDIUM_STORE


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tools.models.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("kv-events-store") / "tiny", preset="tiny", seed=0)


@pytest.fixture
def master(tmp_path):
    master = Master(tmp_path)
    yield master
    master.kill()


def store_engine(model, master):
    engine = start_engine(model, num_pages=64, page_size=PAGE, chunked_prefill_size=64,
                          enable_hierarchical_cache=True, hicache_mooncake_master=master.address,
                          hicache_mooncake_segment_mb=32)
    wait_for(lambda: engine.hicache.up, "the store tier to connect")
    return engine


async def run(engine, prompt, room):
    async for _ in generate(engine, prompt, PARAMS, room):
        pass


async def read_until(stream, want: set[tuple[int, int, int]]) -> list[worker_pb2.KvEventBatch]:
    """Batches until every (kind, medium, page hash) in `want` was seen."""
    batches = []
    while want:
        batch = await asyncio.wait_for(stream.read(), 20)
        batches.append(batch)
        want -= {(e.kind, e.medium, h) for e in batch.events for h in e.page_hashes}
    return batches


async def test_written_and_fetched_pages_are_published_as_store_pages(model, master):
    writer, reader = store_engine(model, master), store_engine(model, master)
    servers = []
    try:
        (prompt,) = random_prompts([70], seed=21)
        hashes = page_hashes(prompt, PAGE)  # 4 full pages (the last token is never a full page's)
        reader_servicer = KvEventsServicer(reader)
        servers = [await serve(KvEventsServicer(writer)), await serve(reader_servicer)]
        async with grpc.aio.insecure_channel(servers[1].address) as channel:
            stream = worker_pb2_grpc.KvEventsStub(channel).Subscribe(worker_pb2.KvEventsRequest())
            snapshot = await stream.read()
            assert snapshot.snapshot and snapshot.store == reader.hicache.location
            assert snapshot.store.startswith(f"{master.address}/pdserve/")
            assert not snapshot.events  # nothing cached, nothing in the store yet

            await run(writer, prompt, "write")
            wait_for(lambda: writer.hicache.stats.pages_written >= len(hashes), "the write-through")
            await run(reader, prompt, "fetch")  # a local miss, fetched from the store
            assert reader.hicache.stats.hit_pages == len(hashes)
            batches = await read_until(stream, {(STORED, m, h) for m in (DEVICE, STORE) for h in hashes})
            assert all(b.store == snapshot.store for b in batches)
            store_events = [e for b in batches for e in b.events if e.medium == STORE]
            assert [h for e in store_events for h in e.page_hashes] == hashes  # once each, in order
            assert all(e.kind == STORED for e in store_events)
            stream.cancel()
        for _ in range(200):  # the servicer's cleanup runs on this event loop: yield to it
            if reader_servicer.subscribers == 0:
                break
            await asyncio.sleep(0.05)
        assert reader_servicer.subscribers == 0
        assert reader.hicache._watchers == []

        # The writer's snapshot holds both media: its pool and what it wrote through.
        async with grpc.aio.insecure_channel(servers[0].address) as channel:
            stream = worker_pb2_grpc.KvEventsStub(channel).Subscribe(worker_pb2.KvEventsRequest())
            snapshot = await stream.read()
            by_medium = {e.medium: set(e.page_hashes) for e in snapshot.events}
            assert snapshot.snapshot and set(by_medium) == {DEVICE, STORE}
            assert set(hashes) <= by_medium[DEVICE] and set(hashes) <= by_medium[STORE]
            assert snapshot.store == writer.hicache.location == reader.hicache.location

            # The store goes away: the next write fails, and every STORE page is removed (a
            # restarted master starts empty); the pool's pages stay.
            master.kill()
            await run(writer, random_prompts([40], seed=22)[0], "down")
            batches = await read_until(stream, {(REMOVED, STORE, h) for h in by_medium[STORE]})
            assert not any(e.kind == REMOVED and e.medium == DEVICE for b in batches for e in b.events)
            assert not writer.hicache.up
            stream.cancel()
    finally:
        for server in servers:
            await server.stop(None)
        if master.process.poll() is not None:
            # A store client's close unmounts its segment on the master, holding the GIL until that
            # call ends: about 10 s each when no master answers, at once when one does.
            master.start()
        writer.shutdown()
        reader.shutdown()


async def test_a_worker_without_the_store_names_none(model):
    engine = start_engine(model, num_pages=64, page_size=PAGE)
    server = await serve(KvEventsServicer(engine))
    try:
        await run(engine, random_prompts([40], seed=23)[0], "local")
        async with grpc.aio.insecure_channel(server.address) as channel:
            stream = worker_pb2_grpc.KvEventsStub(channel).Subscribe(worker_pb2.KvEventsRequest())
            snapshot = await stream.read()
            assert snapshot.store == "" and [e.medium for e in snapshot.events] == [DEVICE]
            stream.cancel()
    finally:
        await server.stop(None)
        engine.shutdown()
