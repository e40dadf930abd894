"""Decode's channels to prefill workers (services/decode/prefill_client.py): an address is not an
identity, so a channel is dropped when the process behind it may have changed, and the next call
opens a fresh one with its own connections. Real grpc.aio channels; nothing listens behind them."""

from __future__ import annotations

import asyncio
import socket

import grpc

from engine.sampling import SamplingParams
from protos.v1 import worker_pb2
from services.decode.prefill_client import AbortOutcome, PrefillClients, PrefillFailed


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens there once the socket is closed


def test_forget_opens_a_new_channel_and_only_for_the_channel_named():
    async def go():
        clients = PrefillClients(abort_timeout_s=1.0)
        _, first = clients._stub("127.0.0.1:1")
        assert clients._stub("127.0.0.1:1")[1] is first  # cached
        _, other = clients._stub("127.0.0.1:2")
        clients.forget("127.0.0.1:1", other)  # not that address's channel: a call already replaced it
        assert clients._stub("127.0.0.1:1")[1] is first
        clients.forget("127.0.0.1:1")
        _, second = clients._stub("127.0.0.1:1")
        assert second is not first
        clients.forget("127.0.0.1:9")  # unknown address: nothing to do
        await clients.close()
        assert first.get_state() == grpc.ChannelConnectivity.SHUTDOWN  # a retired channel closes too
        assert second.get_state() == grpc.ChannelConnectivity.SHUTDOWN
    asyncio.run(go())


def test_a_refused_address_is_gone_and_its_channel_dropped():
    async def go():
        clients = PrefillClients(abort_timeout_s=2.0)
        address = f"127.0.0.1:{_closed_port()}"
        _, channel = clients._stub(address)
        reply = await clients.abort(address, "room-1")
        assert reply.outcome is AbortOutcome.GONE
        assert clients._stub(address)[1] is not channel  # the next call does not inherit its backoff
        await clients.close()
    asyncio.run(go())


def test_prefill_failure_drops_the_channel():
    async def go():
        clients = PrefillClients(abort_timeout_s=2.0)
        address = f"127.0.0.1:{_closed_port()}"
        _, channel = clients._stub(address)
        try:
            await clients.prefill(address, worker_pb2.PrefillRequest(room="r"), SamplingParams(),
                                  timeout_s=5.0)
        except PrefillFailed as exc:
            assert exc.code == grpc.StatusCode.UNAVAILABLE and address in str(exc)
        else:
            raise AssertionError("a Prefill call to a closed port succeeded")
        assert clients._stub(address)[1] is not channel
        await clients.close()
    asyncio.run(go())
