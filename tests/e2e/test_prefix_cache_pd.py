"""Prefix caching across real PD processes (registry + prefill + decode on mooncake).

A second request sharing a prompt's leading pages transfers fewer bytes (decode reuses the pages
its prefix cache holds and tells prefill to skip them), prefill computes fewer tokens, and every
output equals the colocated worker's with the cache off. Forged skip counts are refused before
anything is written. Afterwards every worker's pages in use are back at zero and the leak
detector stayed quiet (cached pages nobody uses count as free).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from protos.v1 import bootstrap_pb2, bootstrap_pb2_grpc, common_pb2, worker_pb2, worker_pb2_grpc
from tests.e2e.cluster import Cluster, worker_args
from tests.e2e.test_pd_services import assert_pages_idle, prompts_of
from tests.e2e.worker_client import run_all

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

PAGE = 16
NEW_TOKENS = 12
POOL = ("--num-pages", "256", "--chunked-prefill-size", "64")


def conversation() -> list[list[int]]:
    """A first turn, a second turn extending it, a prompt sharing only a page-unaligned prefix."""
    base, more, other = prompts_of([100, 40, 30], seed=5)
    return [base, base + more, base[:PAGE * 3 + 5] + other]


def test_decode_reuse_transfers_fewer_bytes_with_identical_output(cluster: Cluster, tiny_model):
    bootstrap = cluster.bootstrap()
    colocated, prefill, decode = cluster.start_many([
        ("colocated", worker_args(tiny_model, "null", extra=(*POOL, "--disable-radix-cache"))),
        ("prefill", worker_args(tiny_model, "prefill", backend="mooncake", bootstrap=bootstrap, extra=POOL)),
        ("decode", worker_args(tiny_model, "decode", backend="mooncake", bootstrap=bootstrap, extra=POOL)),
    ])
    prompts = conversation()
    expected = run_all(colocated.address, prompts, max_new_tokens=NEW_TOKENS)
    sent, saved = [], []
    for i, prompt in enumerate(prompts):
        before = prefill.metric("pdserve:kv_transfer_bytes_total")
        saved_before = decode.metric("pdserve:kv_transfer_bytes_saved_total")
        (result,) = run_all(decode.address, [prompt], [prefill.address], max_new_tokens=NEW_TOKENS)
        assert result.code is None, result.details
        assert result.tokens == expected[i].tokens, \
            f"turn {i}: PD with the cache differs from colocated without"
        worst = max(abs(a - b) for a, b in zip(result.logprobs, expected[i].logprobs, strict=True))
        assert worst < 1e-4, f"turn {i}: logprobs off by {worst}"
        sent.append(prefill.metric("pdserve:kv_transfer_bytes_total") - before)
        saved.append(decode.metric("pdserve:kv_transfer_bytes_saved_total") - saved_before)
    page_bytes = sent[0] / -(-len(prompts[0]) // PAGE)
    # Turn 2: decode holds the first turn's 6 full prompt pages, so only the other 3 cross.
    assert saved[0] == 0 and saved[1] == 6 * page_bytes, saved
    assert sent[1] == 3 * page_bytes, sent
    assert saved[2] == 3 * page_bytes and sent[2] < sent[0]
    assert prefill.metric("pdserve:prefix_cache_hit_tokens_total") > 0
    assert decode.metric("pdserve:prefix_cache_hit_tokens_total") == (6 + 3) * PAGE
    assert colocated.metric("pdserve:prefix_cache_query_tokens_total") == 0  # the flag turns it off
    assert_pages_idle(prefill, decode, colocated)


def test_forged_skip_counts_are_refused(cluster: Cluster, tiny_model):
    bootstrap = cluster.bootstrap()
    prefill, _decode = cluster.start_many([
        ("prefill", worker_args(tiny_model, "prefill", backend="mooncake", bootstrap=bootstrap, extra=POOL)),
        ("decode", worker_args(tiny_model, "decode", backend="mooncake", bootstrap=bootstrap, extra=POOL)),
    ])
    prompt = list(range(100, 150))  # 3 full pages and 2 tokens

    async def call(skip: int, dst: list[int]) -> tuple[grpc.StatusCode, str]:
        async with grpc.aio.insecure_channel(bootstrap.address) as channel:
            listed = await bootstrap_pb2_grpc.BootstrapStub(channel).List(
                bootstrap_pb2.ListRequest(role=common_pb2.WORKER_ROLE_DECODE), timeout=10)
        async with grpc.aio.insecure_channel(prefill.address) as channel:
            request = worker_pb2.PrefillRequest(
                room=f"forged-skip-{skip}-{len(dst)}", prompt_token_ids=prompt, model="tiny",
                dst_page_ids=dst, dst=listed.workers[0].transfer_endpoint, skip_pages=skip,
                sampling=common_pb2.SamplingParams(temperature=0, max_new_tokens=1))
            try:
                await worker_pb2_grpc.PrefillStub(channel).Prefill(request, timeout=30)
                return grpc.StatusCode.OK, ""
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details()

    for skip, dst, message in [(-1, [0, 1, 2, 3, 4], "skip_pages: -1"),
                               (4, [], "skip_pages: 4 is not between 0 and the prompt's 3 full pages"),
                               (1000, [], "skip_pages: 1000"),
                               (2, [0, 1, 2, 3],
                                "4 destination pages for a prompt that needs 2 after 2 skipped"),
                               (3, [], "0 destination pages for a prompt that needs 1 after 3 skipped"),
                               (3, [5], None)]:
        code, details = asyncio.run(call(skip, dst))
        if message is None:  # well formed, but decode reserved nothing for this room: still no write
            assert code == grpc.StatusCode.PERMISSION_DENIED, (code, details)
            continue
        assert code == grpc.StatusCode.INVALID_ARGUMENT and message in details, (skip, code, details)
    assert prefill.metric("pdserve:kv_transfer_bytes_total") == 0
    assert_pages_idle(prefill, _decode)
