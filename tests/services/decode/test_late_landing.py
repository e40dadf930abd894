"""Decode never takes KV as landed before its bytes arrive, even when the page it reserved already
holds exactly those bytes (the same prompt's tail page, reused). A one-sided write is done for
the sender once it is sent; decode's landing check compares the page with prefill's checksum,
and a page left over from the previous identical request used to match at once. The request
then went on (or, cancelled, freed the page) while the bytes were still on their way, and they
landed later in a page that by then belonged to another request.

Real engines and real gRPC services for prefill and decode in this process; the transfer engine
is an in-process one whose writes the test holds back (tests/libkv/transfer/late_landing.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy
import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.generate_response import response_token_ids
from services.common.grpc_server import ServiceBinding, service_name, start_grpc_server
from services.decode.servicer import DecodeServicer
from services.prefill.servicer import PrefillServicer
from services.worker.config import WorkerConfig
from services.worker.metrics import WorkerMetrics
from services.worker.runtime import WorkerRuntime
from tests.engine.conftest import random_prompts
from tests.libkv.transfer.late_landing import LateLandingBackend
from tools.models.tiny_model import write_tiny_model

# 40 tokens in pages of 16: two full pages (decode's prefix cache keeps them after the first
# request) and a partial one, the page a repeated request reserves again and has written.
(PROMPT,) = random_prompts([40], seed=11)


@contextmanager
def _runtime(model: Path, role: str) -> Iterator[WorkerRuntime]:
    config = WorkerConfig(engine=EngineConfig(model_path=str(model), num_pages=64, num_threads=1),
                          disaggregation_mode=role, disaggregation_transfer_backend="fake")
    engine = Engine.load(config.engine)
    backend = LateLandingBackend()
    backend.register(engine.pool)
    engine.start()
    try:
        yield WorkerRuntime(config=config, engine=engine, backend=backend,
                            metrics=WorkerMetrics(role, config.model_name))
    finally:
        engine.shutdown()
        backend.close()


@dataclass
class Pair:
    prefill: WorkerRuntime
    decode: WorkerRuntime


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Iterator[Pair]:
    model = write_tiny_model(tmp_path_factory.mktemp("late-landing") / "tiny", preset="tiny", seed=0)
    with _runtime(model, "prefill") as prefill, _runtime(model, "decode") as decode:
        yield Pair(prefill, decode)


@dataclass
class Served:
    decode: worker_pb2_grpc.WorkerStub
    decode_servicer: DecodeServicer
    prefill_address: str


@asynccontextmanager
async def _served(pair: Pair) -> AsyncIterator[Served]:
    prefill = await start_grpc_server([ServiceBinding(service_name(worker_pb2, "Prefill"),
                                                      PrefillServicer(pair.prefill),
                                                      worker_pb2_grpc.add_PrefillServicer_to_server)],
                                      "127.0.0.1", 0)
    servicer = DecodeServicer(pair.decode)
    decode = await start_grpc_server([ServiceBinding(service_name(worker_pb2, "Worker"), servicer,
                                                     worker_pb2_grpc.add_WorkerServicer_to_server)],
                                     "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(decode.address) as channel:
            yield Served(worker_pb2_grpc.WorkerStub(channel), servicer, prefill.address)
    finally:
        await servicer.close()
        await decode.stop(0)
        await prefill.stop(0)


def _generate(served: Served, room: str):
    return served.decode.Generate(worker_pb2.GenerateRequest(
        room=room, prompt_token_ids=PROMPT, prefill_address=served.prefill_address,
        sampling=common_pb2.SamplingParams(temperature=0, max_new_tokens=1)), timeout=60)


async def _tokens(call) -> list[int]:
    return [token_id async for response in call for token_id in response_token_ids(response)]


async def _until(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def _same_bytes(a, b) -> bool:
    return [dst for dst, _ in a.pieces] == [dst for dst, _ in b.pieces] and \
        all(numpy.array_equal(x, y) for (_, x), (_, y) in zip(a.pieces, b.pieces, strict=True))


async def _held_write_of_repeat(pair: Pair, served: Served, room: str):
    """Run PROMPT once with writes landing at once, then start it again under `room` with the
    write held back; returns (first run's tokens, the repeat's call) once the write is held and
    checked to carry exactly the bytes decode's page already holds."""
    sender: LateLandingBackend = pair.prefill.backend  # type: ignore[assignment]
    sender.hold_writes = False
    for warm in range(2):  # the second run writes only the partial page, as the repeat will
        expected = await _tokens(_generate(served, f"{room}-warm-{warm}"))
    before = sender.sent[-1]
    sender.hold_writes = True
    call = _generate(served, room)
    reading = asyncio.ensure_future(_tokens(call))
    await _until(lambda: sender.held or reading.done(), "prefill's write")
    assert sender.held, f"the repeat finished without writing: {reading.result()}"
    assert _same_bytes(sender.held[0], before), \
        "precondition: the repeated request's write should carry the bytes its page already holds"
    return expected, call, reading


async def test_decode_waits_for_bytes_its_page_already_seemed_to_hold(pair: Pair):
    sender: LateLandingBackend = pair.prefill.backend  # type: ignore[assignment]
    async with _served(pair) as served:
        expected, _call, reading = await _held_write_of_repeat(pair, served, "repeat")
        try:
            done, _ = await asyncio.wait({reading}, timeout=1.0)
            assert not done, "decode answered although the prompt's KV had not landed yet"
        finally:
            sender.hold_writes = False
            sender.land()
        assert await reading == expected


@pytest.mark.parametrize("gateway_abort", [False, True], ids=["cancelled", "cancelled-and-aborted"])
async def test_a_request_the_client_left_keeps_its_page_until_the_bytes_landed(
        pair: Pair, gateway_abort: bool):
    """The client goes away while the KV is on its way. With `gateway_abort`, as the gateway does:
    the call is cancelled and Worker.Abort sent. That Abort used to abort the room in the engine,
    which freed its reserved pages at once behind the quarantine's back, so the next request got
    the page while the write was in flight."""
    sender: LateLandingBackend = pair.prefill.backend  # type: ignore[assignment]
    pages = pair.decode.engine.pages
    room = f"left-{gateway_abort}"
    async with _served(pair) as served:
        idle = pages.used_pages
        _expected, call, reading = await _held_write_of_repeat(pair, served, room)
        try:
            call.cancel()
            if gateway_abort:
                assert (await served.decode.Abort(worker_pb2.AbortRequest(room=room), timeout=30)).found
            await asyncio.gather(reading, return_exceptions=True)
            await asyncio.sleep(1.0)
            assert pages.has_room(room), "decode freed the page while bytes for it were still on their way"
        finally:
            sender.hold_writes = False
            sender.land()
        await _until(lambda: not pages.has_room(room) and pages.used_pages == idle,
                     "the pages of the request the client left to be free again")
