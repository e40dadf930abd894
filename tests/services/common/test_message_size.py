"""A request's images travel gateway -> worker and decode -> prefill in one gRPC message, so every
pdserve server and channel takes messages up to MAX_MESSAGE_BYTES (gRPC's default receive limit is
4 MiB: a 5 MB image was cut off between two workers), and the gateway refuses an image budget that
would not fit in one."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.channels import open_channel
from services.common.grpc_server import start_grpc_server
from services.common.keepalive import MAX_MESSAGE_BYTES, MESSAGE_ROOM_BYTES
from services.common.security import GrpcSecurity
from services.gateway.config import GatewayConfig

pytestmark = pytest.mark.timeout(60)

BIG = 10 << 20  # bytes of one message: more than gRPC's default 4 MiB, less than pdserve's limit


async def _send_big(server_options=()) -> grpc.StatusCode:
    server = await start_grpc_server([], "127.0.0.1", 0, options=server_options)
    try:
        async with open_channel(server.address, GrpcSecurity()) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            try:
                await health.Check(health_pb2.HealthCheckRequest(service="x" * BIG), timeout=20)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK
    finally:
        await server.stop(0)


async def test_a_message_over_grpcs_default_limit_reaches_the_server():
    # The health service does not know a service of that name: NOT_FOUND means the message arrived.
    assert await _send_big() == grpc.StatusCode.NOT_FOUND


async def test_with_grpcs_default_limit_the_same_message_is_refused():
    """The check above can fail: a server with gRPC's default receive limit refuses it."""
    status = await _send_big((("grpc.max_receive_message_length", 4 << 20),))
    assert status == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_the_gateway_refuses_an_image_budget_one_message_cannot_carry():
    assert BIG < MAX_MESSAGE_BYTES - MESSAGE_ROOM_BYTES
    GatewayConfig(max_request_image_bytes=MAX_MESSAGE_BYTES - MESSAGE_ROOM_BYTES)
    with pytest.raises(ValueError, match="--max-request-image-bytes must be at most"):
        GatewayConfig(max_request_image_bytes=MAX_MESSAGE_BYTES)
