"""The prefill service does not fail a request because its kept connection to decode went stale:
when the engine reports the peer unreachable at the grant check (NIXL after a network cut), the
connection is dropped and one fresh connection is tried. If that fails too, the request fails
UNAVAILABLE with the engine's reason and no page stays held. Real gRPC server, real engine; the
transfer engine's broken connection is injected (tests/libkv/transfer/broken_connections.py)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.grpc_server import ServiceBinding, service_name, start_grpc_server
from services.prefill.servicer import PrefillServicer
from services.worker.rooms import QUEUES
from services.worker.wire import endpoint_to_proto
from tests.engine.conftest import random_prompts
from tests.libkv.transfer.broken_connections import BrokenConnections
from tests.services.prefill.runtime import prefill_runtime


class BrokenUntilReconnected(BrokenConnections):
    """`break_existing()` breaks every connection made so far (a network cut); the next
    `broken_left` connections are made broken too."""

    broken_left = 0

    def break_existing(self) -> None:
        for peer in self._peers.values():
            peer.engine["broken"] = True

    def _engine_connect(self, endpoint):
        self.break_next = self.broken_left > 0
        self.broken_left = max(0, self.broken_left - 1)
        return super()._engine_connect(endpoint)


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    with prefill_runtime(tmp_path_factory.mktemp("prefill"), BrokenUntilReconnected(timeout_s=10)) as started:
        yield started


async def prefill(runtime, room: str):
    server = await start_grpc_server([ServiceBinding(service_name(worker_pb2, "Prefill"),
                                                     PrefillServicer(runtime),
                                                     worker_pb2_grpc.add_PrefillServicer_to_server)],
                                     "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            (prompt,) = random_prompts([40], seed=3)
            pages = runtime.engine.pages.pages_for(len(prompt))
            return await worker_pb2_grpc.PrefillStub(channel).Prefill(worker_pb2.PrefillRequest(
                room=room, prompt_token_ids=prompt, model=runtime.config.model_name,
                sampling=common_pb2.SamplingParams(temperature=0, max_new_tokens=2),
                dst_page_ids=list(range(10, 10 + pages)), dst=endpoint_to_proto(runtime.backend.endpoint())),
                timeout=60)
    finally:
        await server.stop(0)


async def test_a_stale_connection_is_replaced_and_the_request_succeeds(runtime):
    assert (await prefill(runtime, "room-warm")).num_pages_written > 0  # a connection is kept
    runtime.backend.break_existing()
    before = runtime.backend.connections
    reply = await prefill(runtime, "room-stale")
    assert reply.num_pages_written > 0
    assert runtime.backend.connections == before + 1  # one fresh connection replaced the stale one
    assert runtime.engine.stats().used_pages == 0


async def test_a_peer_still_unreachable_after_reconnecting_fails_the_request_cleanly(runtime):
    assert (await prefill(runtime, "room-warm-2")).num_pages_written > 0
    runtime.backend.break_existing()
    runtime.backend.broken_left = 1  # the fresh connection fails too: the peer is really unreachable
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await prefill(runtime, "room-unreachable")
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "REMOTE_DISCONNECT" in failed.value.details()
    # The error reaches the caller before the room's cleanup has finished: wait for it, bounded.
    deadline = time.monotonic() + 10
    while (runtime.rooms.counts() != {stage.value: 0 for stage in QUEUES["prefill"]}
           and time.monotonic() < deadline):
        await asyncio.sleep(0.01)
    assert runtime.rooms.counts() == {stage.value: 0 for stage in QUEUES["prefill"]}
    assert runtime.engine.stats().used_pages == 0
