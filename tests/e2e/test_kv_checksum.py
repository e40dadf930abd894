"""KV integrity: pages that arrive different from what prefill sent fail the request before it
joins the batch, with a clear retryable status, a `checksum` failure in the metrics and every page
freed.

Between a real decode and a real prefill (mooncake) sits a relay speaking pdserve.v1.Prefill: it
passes each call through unchanged (the grant included, so prefill really writes decode's pages)
and, when told to, changes one checksum in prefill's reply. From decode's side that is exactly a
page corrupted on the way: the bytes it holds no longer match what prefill computed before writing.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from protos.v1 import worker_pb2_grpc
from services.common.channels import open_channel
from services.common.security import GrpcSecurity
from tests.e2e.cluster import Cluster, worker_args
from tests.e2e.test_pd_services import assert_pages_idle, prompts_of
from tests.e2e.worker_client import generate

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


class TamperingRelay(worker_pb2_grpc.PrefillServicer):
    """Forwards Prefill and Abort to `upstream`; flips one bit of one page checksum in the reply
    while `tamper` is set."""

    def __init__(self, upstream: str) -> None:
        self.channel = open_channel(upstream, GrpcSecurity())
        self.stub = worker_pb2_grpc.PrefillStub(self.channel)
        self.tamper = False

    async def Prefill(self, request, context):
        reply = await self.stub.Prefill(request, timeout=context.time_remaining())
        if self.tamper and reply.page_checksums:
            reply.page_checksums[len(reply.page_checksums) // 2] ^= 1
        return reply

    async def Abort(self, request, context):
        return await self.stub.Abort(request, timeout=context.time_remaining())


async def run_through_relay(decode_address: str, prefill_address: str, prompt: list[int]):
    relay = TamperingRelay(prefill_address)
    server = grpc.aio.server()
    worker_pb2_grpc.add_PrefillServicer_to_server(relay, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with open_channel(decode_address, GrpcSecurity()) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            via = f"127.0.0.1:{port}"
            clean = await generate(stub, prompt, prefill=via, max_new_tokens=8)
            relay.tamper = True
            corrupted = await generate(stub, prompt, prefill=via, max_new_tokens=8)
            relay.tamper = False
            again = await generate(stub, prompt, prefill=via, max_new_tokens=8)
        return clean, corrupted, again
    finally:
        await server.stop(None)
        await relay.channel.close()


def test_corrupted_pages_fail_the_request_and_free_its_pages(cluster: Cluster, tiny_model):
    bootstrap = cluster.bootstrap()
    prefill, decode = cluster.start_many([
        ("prefill", worker_args(tiny_model, "prefill", backend="mooncake", bootstrap=bootstrap)),
        # The prompt repeats: without its prefix cache decode reuses no page, so all 7 are written
        # every time (with it, only the last one would be: test_prefix_cache_pd.py).
        ("decode", worker_args(tiny_model, "decode", backend="mooncake", bootstrap=bootstrap,
                               extra=("--disable-radix-cache",))),
    ])
    prompt = prompts_of([100])[0]  # 7 pages of 16 tokens

    clean, corrupted, again = asyncio.run(run_through_relay(decode.address, prefill.address, prompt))

    assert clean.code is None, clean.details
    assert corrupted.code == grpc.StatusCode.UNAVAILABLE  # the gateway retries it on another pair
    assert "arrived corrupted" in corrupted.details and "1 of 7 pages differ" in corrupted.details
    assert corrupted.tokens == []  # refused before it joined the batch: not one token came out
    assert again.code is None and again.tokens == clean.tokens
    assert decode.metric("pdserve:pd_failures_total", stage="checksum") == 1
    assert_pages_idle(prefill, decode)
