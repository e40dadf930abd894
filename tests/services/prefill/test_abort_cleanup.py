"""Finding 8.1: a prefill whose Prefill call is cancelled and then aborted frees every page.

The prefill servicer runs in a real grpc.aio server over a real engine (tiny model). Its backend
is the `fake` one with two changes that make the race of the finding certain instead of rare
(with Mooncake, an abort waits for the writes in flight, which takes milliseconds): a write stays
in flight until aborted, and an abort takes a while. So the call is cancelled while the prompt's
writes are in flight (inflight queue), and decode's Abort arrives while that cancellation is
still being cleaned up, the second cancellation that used to skip freeing the pages. Either
Abort reply carries the checksums of the writes issued, which decode waits on before reusing the
pages (libkv/landing.py).
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from libkv.transfer import TransferState
from libkv.transfer.fake import FakeBackend
from libkv.transfer.hooks import Transfer
from protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.grpc_server import ServiceBinding, service_name, start_grpc_server
from services.prefill.servicer import PrefillServicer
from services.worker.rooms import QUEUES, Stage
from services.worker.wire import endpoint_to_proto
from tests.engine.conftest import random_prompts
from tests.services.prefill.runtime import prefill_runtime as make_prefill_runtime

ABORT_TAKES_S = 0.5


class HeldWritesBackend(FakeBackend):
    """Writes never finish by themselves; abort() takes ABORT_TAKES_S, as a slow engine's would."""

    def _engine_progress(self, record: Transfer) -> TransferState:
        return TransferState.PENDING

    def _engine_cancel(self, record: Transfer, deadline: float) -> None:
        time.sleep(ABORT_TAKES_S)


@pytest.fixture(scope="module")
def prefill_runtime(tmp_path_factory):
    with make_prefill_runtime(tmp_path_factory.mktemp("prefill"), HeldWritesBackend(timeout_s=30)) as runtime:
        yield runtime


async def _wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("second_cancel", ["abort_rpc", "none"])
async def test_cancelled_then_aborted_prefill_frees_its_pages(prefill_runtime, second_cancel):
    runtime = prefill_runtime
    servicer = PrefillServicer(runtime)
    server = await start_grpc_server([ServiceBinding(service_name(worker_pb2, "Prefill"), servicer,
                                                     worker_pb2_grpc.add_PrefillServicer_to_server)],
                                     "127.0.0.1", 0)
    engine = runtime.engine
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = worker_pb2_grpc.PrefillStub(channel)
            (prompt,) = random_prompts([100], seed=1)
            pages = engine.pages.pages_for(len(prompt))
            room = f"room-{second_cancel}"
            call = stub.Prefill(worker_pb2.PrefillRequest(
                room=room, prompt_token_ids=prompt, model=runtime.config.model_name,
                sampling=common_pb2.SamplingParams(temperature=0, max_new_tokens=4),
                dst_page_ids=list(range(10, 10 + pages)), dst=endpoint_to_proto(runtime.backend.endpoint()),
                page_checksums=True))
            await _wait_for(lambda: getattr(runtime.rooms.get(room), "stage", None) is Stage.INFLIGHT, 30,
                            "the prompt's writes in flight")
            assert engine.stats().used_pages == pages  # held until the writes finish or are aborted
            call.cancel()  # decode gone: the first cancellation
            if second_cancel == "abort_rpc":
                await asyncio.sleep(ABORT_TAKES_S / 5)  # the cleanup is now waiting for the abort
                reply = await stub.Abort(worker_pb2.AbortRequest(room=room), timeout=10)
                assert reply.found
                # Every write was issued: decode must wait for all of them to land before reuse.
                assert len(reply.page_checksums) == pages
            await _wait_for(lambda: engine.stats().used_pages == 0, 10, "the room's pages to be freed")
            # An Abort after the room was stopped (decode cancels the call before it aborts) still
            # learns the checksums of the writes issued, which may still be landing.
            late = await stub.Abort(worker_pb2.AbortRequest(room=room), timeout=10)
            assert not late.found and len(late.page_checksums) == pages
            assert runtime.rooms.counts() == {stage.value: 0 for stage in QUEUES["prefill"]}
            # A Prefill for a room that was aborted is refused, not run into reused pages.
            if second_cancel == "abort_rpc":
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Prefill(worker_pb2.PrefillRequest(room=room, prompt_token_ids=prompt,
                                                                 model=runtime.config.model_name,
                                                                 dst_page_ids=list(range(pages)),
                                                                 dst=endpoint_to_proto(runtime.backend.endpoint())))
                assert refused.value.code() == grpc.StatusCode.ABORTED
    finally:
        await server.stop(0)
