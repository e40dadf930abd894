"""An abort that lands after prefill finished a request and before decode's batch took it.

In that window decode holds the room's pages as a bare reservation: the KV landed, the prefill is
done with the room (its own pages are free), and decode's engine does not know the request yet. An
Abort RPC or the client leaving must still free the pages on both sides, and the worker must go on
serving. The decode worker, started with a hook (tools/hooked_worker.py --hold-admission; the seam is
RemotePrefill._before_admission), holds the test's rooms at exactly that point until they are
aborted, so every abort lands in the window by construction, with no timing involved.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.channels import open_channel
from services.common.generate_response import response_token_ids
from services.common.security import GrpcSecurity
from tests.e2e.cluster import Cluster, Proc, wait_until, worker_args
from tests.e2e.test_pd_services import assert_pages_idle, prompts_of
from tests.e2e.worker_client import greedy, run_all

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

BACKEND = "mooncake"
HELD = "held-"
LENGTHS = [40, 90, 150, 200]
BOUND_S = 30.0


def in_the_window(prefill: Proc, decode: Proc, prompt_tokens: int, rooms: int) -> bool:
    """Prefill ran every prompt and freed its pages; decode holds every room, pages reserved."""
    return (prefill.metric("pdserve:prompt_tokens_total") == prompt_tokens
            and prefill.metric("pdserve:kv_pages_used") == 0
            and decode.metric("pdserve:queue_requests", queue="transfer") == rooms
            and decode.metric("pdserve:kv_pages_used") > 0)


async def abort_in_window(prefill: Proc, decode: Proc) -> list[tuple[int, int] | grpc.aio.AioRpcError]:
    """Generate the prompts in held rooms; once all are in the window, abort half of them with the
    Abort RPC and leave the others as a client does (cancel the call). The aborted calls' outcomes."""
    prompts = prompts_of(LENGTHS, seed=5)
    async with open_channel(decode.address, GrpcSecurity()) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        calls = [stub.Generate(worker_pb2.GenerateRequest(room=f"{HELD}{i}", prompt_token_ids=p,
                                                          sampling=greedy(4),
                                                          prefill_address=prefill.address))
                 for i, p in enumerate(prompts)]
        readers = [asyncio.ensure_future(_drain(call)) for call in calls]
        await asyncio.to_thread(wait_until,
                                lambda: in_the_window(prefill, decode, sum(LENGTHS), len(prompts)),
                                BOUND_S, "every request to sit between its KV landing and admission")
        half = len(calls) // 2
        for i in range(half):
            reply = await stub.Abort(worker_pb2.AbortRequest(room=f"{HELD}{i}"), timeout=BOUND_S)
            assert reply.found
        aborted = await asyncio.wait_for(asyncio.gather(*readers[:half]), BOUND_S)
        for call, reader in zip(calls[half:], readers[half:], strict=True):
            call.cancel()
            reader.cancel()
        await asyncio.gather(*readers[half:], return_exceptions=True)
        return aborted


async def _drain(call) -> tuple[int, int] | grpc.aio.AioRpcError:
    """(finish reason, tokens) of the stream, or its error."""
    tokens, reason = 0, common_pb2.FINISH_REASON_UNSPECIFIED
    try:
        async for response in call:
            tokens += len(response_token_ids(response))
            reason = response.finish_reason or reason
    except grpc.aio.AioRpcError as exc:
        return exc
    return reason, tokens


def test_abort_between_prefill_done_and_admission_frees_pages(cluster: Cluster, tiny_model):
    prefill = cluster.spawn("prefill", worker_args(tiny_model, "prefill", backend=BACKEND))
    decode = cluster.spawn("decode",
                           ["--hold-admission", HELD, *worker_args(tiny_model, "decode", backend=BACKEND)],
                           module="tools.hooked_worker")
    prefill, decode = prefill.wait_ready(180), decode.wait_ready(180)
    outcomes = asyncio.run(abort_in_window(prefill, decode))
    half = len(LENGTHS) // 2
    # Aborted: the stream ends at once, as a colocated worker's does: finish reason abort, no token.
    assert outcomes == [(common_pb2.FINISH_REASON_ABORT, 0)] * half
    assert_pages_idle(decode, prefill, timeout_s=BOUND_S)
    # Unheld rooms are served as usual afterwards, by the same pair.
    results = run_all(decode.address, prompts_of(LENGTHS), [prefill.address] * len(LENGTHS), max_new_tokens=4)
    assert [(r.code, len(r.tokens)) for r in results] == [(None, 4)] * len(LENGTHS)
    assert_pages_idle(decode, prefill, timeout_s=BOUND_S)
