"""A Generate request's images written into its wire bytes (services/gateway/image_wire.py) parse as
the message built with them, and a worker's Generate receives them so over gRPC."""

from __future__ import annotations

import os

import grpc

from protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.gateway.image_wire import encode_generate_request, generate_call


def request() -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(room="r1", prompt_token_ids=[5, 6, 7], lora_adapter="a",
                                      sampling=common_pb2.SamplingParams(max_new_tokens=3), carried_tokens=2,
                                      prefill_address="127.0.0.1:1")


def test_images_in_the_wire_parse_as_the_message_built_with_them():
    # sizes around each varint length boundary, and none
    for images in ([], [b""], [b"x" * 127, b"y" * 128], [os.urandom(16_384), os.urandom(300_000)]):
        built = request()
        built.images.extend(images)
        parsed = worker_pb2.GenerateRequest.FromString(encode_generate_request(request(), images))
        assert parsed == built and list(parsed.images) == images


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
