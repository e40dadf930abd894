"""Finding 8.4: idle channels between pdserve processes are not torn down by ping policy.

Decode's channel to a prefill pings while idle; a server with gRPC's default ping policy answered
with GOAWAY too_many_pings after a few pings and failed the calls just starting on it. Here the
interval is shortened to 0.5 s (PDSERVE_GRPC_KEEPALIVE_TIME, read by both sides), so the same
number of pings takes seconds instead of a minute: the connection must stay READY throughout.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.channels import open_channel
from services.common.grpc_server import start_grpc_server
from services.common.security import GrpcSecurity

pytestmark = pytest.mark.timeout(60)

IDLE_S = 4.0  # eight pings at 0.5 s; gRPC's default policy cuts the connection after three


async def _states_while_idle(server_options_override) -> set[grpc.ChannelConnectivity]:
    server = await start_grpc_server([], "127.0.0.1", 0, options=server_options_override)
    try:
        async with open_channel(server.address, GrpcSecurity()) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            seen = set()
            loop = asyncio.get_running_loop()
            end = loop.time() + IDLE_S
            while loop.time() < end:
                seen.add(channel.get_state())
                await asyncio.sleep(0.05)
            await health.Check(health_pb2.HealthCheckRequest(), timeout=5)  # and it still works
            return seen
    finally:
        await server.stop(0)


async def test_idle_channel_survives_keepalive_pings(monkeypatch):
    monkeypatch.setenv("PDSERVE_GRPC_KEEPALIVE_TIME", "0.5")
    assert await _states_while_idle(()) == {grpc.ChannelConnectivity.READY}


async def test_a_server_with_grpc_default_ping_policy_would_cut_it(monkeypatch):
    """The check above can fail: against gRPC's default server policy the same client is cut off."""
    monkeypatch.setenv("PDSERVE_GRPC_KEEPALIVE_TIME", "0.5")
    grpc_defaults = (("grpc.keepalive_permit_without_calls", 0),
                     ("grpc.http2.min_ping_interval_without_data_ms", 300_000),
                     ("grpc.keepalive_time_ms", 7_200_000))
    states = await _states_while_idle(grpc_defaults)
    assert states != {grpc.ChannelConnectivity.READY}
