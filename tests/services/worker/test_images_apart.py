"""A worker's Generate and a prefill's Prefill get a large request's images as views into the bytes
gRPC received (services/worker/images_apart.py), equal to what was sent, over real gRPC servers; a
small request arrives as the plain message."""

from __future__ import annotations

import os
import socket

import grpc
import pytest

from engine.sampling import SamplingParams
from protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.image_drop import DropTarget, ImageDrop
from services.decode.prefill_client import PrefillClients
from services.gateway.image_wire import generate_call
from services.worker.images_apart import APART_FROM_BYTES, ImagesApart, TicketNotHeld, adder
from services.worker.wire import BadRequest, parse


class _Worker(worker_pb2_grpc.WorkerServicer):
    def __init__(self) -> None:
        self.received: list = []

    async def Generate(self, request, context):
        self.received.append(request)
        yield worker_pb2.GenerateResponse(finish_reason=common_pb2.FINISH_REASON_LENGTH)


class _Prefill(worker_pb2_grpc.PrefillServicer):
    def __init__(self) -> None:
        self.received: list = []

    async def Prefill(self, request, context):
        self.received.append(request)
        return worker_pb2.PrefillResponse(first_token=common_pb2.TokenOutput(token_id=7), tp_size=1)


async def _serving(servicer, service: str, drop: ImageDrop | None = None) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    adder(service, drop)(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _generate_request() -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(room="r1", prompt_token_ids=[5, 6, 7], lora_adapter="a",
                                      sampling=common_pb2.SamplingParams(max_new_tokens=3),
                                      prefill_address="127.0.0.1:1")


async def test_a_large_generate_request_arrives_with_its_images_apart_and_a_small_one_whole():
    servicer = _Worker()
    server, address = await _serving(servicer, "Worker")
    big = [os.urandom(APART_FROM_BYTES), b"\x89PNG"]
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            for images in (big, [b"small"]):
                call = generate_call(channel, _generate_request(), images)
                assert [r.finish_reason async for r in call] == [common_pb2.FINISH_REASON_LENGTH]
    finally:
        await server.stop(0)
    large, small = servicer.received
    assert isinstance(large, ImagesApart) and [bytes(image) for image in large.images] == big
    assert all(isinstance(image, memoryview) for image in large.images)
    # every other field reads as the message's
    assert (large.room, list(large.prompt_token_ids), large.lora_adapter, large.sampling.max_new_tokens) == (
        "r1", [5, 6, 7], "a", 3)
    assert large.HasField("prefill_address") and large.message == _generate_request()
    assert isinstance(small, worker_pb2.GenerateRequest) and list(small.images) == [b"small"]


async def test_decode_forwards_views_to_a_prefill_which_gets_them_apart():
    servicer = _Prefill()
    server, address = await _serving(servicer, "Prefill")
    image = os.urandom(APART_FROM_BYTES + 5)
    forwarded = memoryview(b"head" + image + b"tail")[4:-4]  # as decode holds them: views
    client = PrefillClients(abort_timeout_s=1.0)
    request = worker_pb2.PrefillRequest(room="r2", prompt_token_ids=[1, 2], model="m", grant=b"g" * 16)
    try:
        reply = await client.prefill(address, request, SamplingParams(), timeout_s=10,
                                     images=[forwarded, b"x"])
        small = await client.prefill(address, request, SamplingParams(), timeout_s=10)
    finally:
        await client.close()
        await server.stop(0)
    assert reply.first.token_id == 7 and small.first.token_id == 7
    received, plain = servicer.received
    assert isinstance(received, ImagesApart) and [bytes(i) for i in received.images] == [image, b"x"]
    assert received.message == request and received.grant == b"g" * 16
    assert plain == request


def test_only_the_image_carrying_services_have_an_adder():
    with pytest.raises(ValueError, match="no images travel"):
        adder("KvEvents")


async def test_a_forged_large_request_is_an_error_and_the_server_serves_on():
    servicer = _Worker()
    server, address = await _serving(servicer, "Worker")
    forged = b"\x2a\xff\xff\xff\x0f" + os.urandom(APART_FROM_BYTES)  # images: a length past the end
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            raw = channel.unary_stream("/pdserve.v1.Worker/Generate", request_serializer=lambda b: b,
                                       response_deserializer=worker_pb2.GenerateResponse.FromString)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                [r async for r in raw(forged, timeout=10)]
            call = generate_call(channel, _generate_request(), [b"x" * APART_FROM_BYTES])
            assert [r.finish_reason async for r in call] == [common_pb2.FINISH_REASON_LENGTH]
    finally:
        await server.stop(0)
    # (gRPC's own answer to a request its deserializer refuses, as for every method: UNKNOWN)
    assert "GenerateRequest" in refused.value.details() and "corrupt" in refused.value.details()
    assert len(servicer.received) == 1 and isinstance(servicer.received[0], ImagesApart)


async def test_large_images_go_through_the_image_drop_and_arrive_as_the_same_views():
    drop = ImageDrop("127.0.0.1", secret=b"k").start()
    servicer = _Worker()
    server, address = await _serving(servicer, "Worker", drop)
    big = [os.urandom(APART_FROM_BYTES), b"\x89PNG"]

    class FindDrop:
        async def image_drop(self) -> DropTarget:
            return DropTarget("127.0.0.1", drop.port, b"k")

        def forget_image_drop(self) -> None:
            raise AssertionError("the upload failed")

    try:
        async with grpc.aio.insecure_channel(address) as channel:
            for images in (big, [b"small"]):  # a small one goes in the call
                call = generate_call(channel, _generate_request(), images, FindDrop())
                assert [r.finish_reason async for r in call] == [common_pb2.FINISH_REASON_LENGTH]
            forged = _generate_request()
            forged.image_ticket = b"t" * 16  # never uploaded
            assert [r async for r in worker_pb2_grpc.WorkerStub(channel).Generate(forged)]
    finally:
        await server.stop(0)
        drop.close()
    dropped, small, forged_received = servicer.received
    assert isinstance(dropped, ImagesApart) and [bytes(image) for image in dropped.images] == big
    assert len(dropped.message.image_ticket) == 16 and not dropped.message.images
    assert isinstance(small, worker_pb2.GenerateRequest) and list(small.images) == [b"small"]
    assert drop.stats.stored == drop.stats.taken == 1 and drop.pending_bytes == 0
    assert isinstance(forged_received.images, TicketNotHeld)
    with pytest.raises(BadRequest, match="image_ticket names no images"):
        await parse(None, "r", [1], common_pb2.SamplingParams(), forged_received.images)  # type: ignore[arg-type]


async def test_an_unreachable_drop_falls_back_to_the_images_in_the_call_and_is_asked_again():
    servicer = _Worker()
    server, address = await _serving(servicer, "Worker")
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # nothing listens here once it is closed
    forgotten: list[bool] = []

    class StaleDrop:  # as a gateway holds a restarted worker's old port
        async def image_drop(self) -> DropTarget:
            return DropTarget("127.0.0.1", port)

        def forget_image_drop(self) -> None:
            forgotten.append(True)

    big = [os.urandom(APART_FROM_BYTES)]
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            call = generate_call(channel, _generate_request(), big, StaleDrop())
            assert [r.finish_reason async for r in call] == [common_pb2.FINISH_REASON_LENGTH]
    finally:
        await server.stop(0)
    (received,) = servicer.received
    assert isinstance(received, ImagesApart) and [bytes(i) for i in received.images] == big
    assert not received.message.image_ticket and forgotten == [True]
