"""A Generate request's images written into its wire bytes (services/gateway/image_wire.py) reach a
worker's Generate over gRPC, and a cancelled call reaches none."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest

from protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.gateway.image_wire import generate_call


def request() -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(room="r1", prompt_token_ids=[5, 6, 7], lora_adapter="a",
                                      sampling=common_pb2.SamplingParams(max_new_tokens=3), carried_tokens=2,
                                      prefill_address="127.0.0.1:1")


class _Echo(worker_pb2_grpc.WorkerServicer):
    def __init__(self) -> None:
        self.received: list[worker_pb2.GenerateRequest] = []

    async def Generate(self, request, context):
        self.received.append(request)
        yield worker_pb2.GenerateResponse(finish_reason=common_pb2.FINISH_REASON_LENGTH)


async def test_a_worker_receives_the_images_over_grpc():
    servicer = _Echo()
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    images = [os.urandom(1 << 20), b"\x89PNG"]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            responses = [r async for r in generate_call(channel, request(), images)]
    finally:
        await server.stop(0)
    expected = request()
    expected.images.extend(images)
    assert servicer.received == [expected]
    assert [r.finish_reason for r in responses] == [common_pb2.FINISH_REASON_LENGTH]


async def test_a_call_cancelled_before_or_while_its_bytes_are_made_reaches_no_worker():
    servicer = _Echo()
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    images = [os.urandom(8 << 20)]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            before = generate_call(channel, request(), images)
            assert before.cancel() and before.cancelled()
            with pytest.raises(asyncio.CancelledError):
                await before.read()
            during = generate_call(channel, request(), images)
            reading = asyncio.ensure_future(during.read())
            await asyncio.sleep(0)  # the read started making the wire bytes in a thread
            during.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reading
            # a call read to its end still works beside them
            assert [r.finish_reason async for r in generate_call(channel, request(), [b"x"])] == [
                common_pb2.FINISH_REASON_LENGTH]
    finally:
        await server.stop(0)
    assert [list(r.images) for r in servicer.received] == [[b"x"]]
