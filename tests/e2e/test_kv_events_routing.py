"""KV events end to end: a worker streams its prefix cache's page hashes (snapshot, then stored
and removed deltas, equal to pdserve.page_hash of the prompt), and a cache_aware gateway routes on
that real state: a prompt whose system prompt was cached on a worker behind the gateway's back
(called directly, so no routing guess could know) goes to that worker.
"""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from pdserve.page_hash import page_hashes
from protos.v1 import worker_pb2, worker_pb2_grpc
from services.common.security import GrpcSecurity
from tests.e2e.cluster import Cluster, wait_until, worker_args
from tests.e2e.test_pd_services import assert_pages_idle, prompts_of
from tests.e2e.worker_client import run_all

pytestmark = [pytest.mark.e2e, pytest.mark.alone, pytest.mark.timeout(300)]

PAGE = 16


async def subscribe(address: str, until, during=None) -> list[worker_pb2.KvEventBatch]:
    """KvEvents batches until `until(batches)` holds; `during` (blocking) runs after the snapshot."""
    got = []
    async with grpc.aio.insecure_channel(address) as channel:
        stream = worker_pb2_grpc.KvEventsStub(channel).Subscribe(worker_pb2.KvEventsRequest(), timeout=60)
        async for batch in stream:
            got.append(batch)
            if len(got) == 1 and during is not None:
                await asyncio.to_thread(during)
            if until(got):
                stream.cancel()
                break
    return got


def hashes_of(batches, kind) -> list[int]:
    return [h for b in batches for e in b.events if e.kind == kind for h in e.page_hashes]


def test_worker_streams_snapshot_then_deltas(cluster: Cluster, tiny_model):
    # 8 pages: a second prompt of 5 pages must evict the first one's idle pages.
    (worker,) = cluster.start_many([("colocated", worker_args(tiny_model, "null",
                                                             extra=("--num-pages", "8")))])
    first, second = prompts_of([70, 75], seed=3)
    expected = page_hashes(first, PAGE)  # the gateway's function must give the worker's hashes
    batches = asyncio.run(subscribe(
        worker.address, lambda got: len(hashes_of(got, worker_pb2.KV_EVENT_KIND_STORED)) >= len(expected),
        lambda: run_all(worker.address, [first], max_new_tokens=4)))
    assert batches[0].snapshot and not batches[0].events and batches[0].page_size == PAGE
    assert not any(b.snapshot for b in batches[1:])
    stored = hashes_of(batches[1:], worker_pb2.KV_EVENT_KIND_STORED)
    assert stored == expected
    # A new subscriber starts from a snapshot holding them; then the second prompt evicts them.
    second_hashes = page_hashes(second, PAGE)
    batches = asyncio.run(subscribe(
        worker.address,
        lambda got: set(second_hashes) <= set(hashes_of(got[1:], worker_pb2.KV_EVENT_KIND_STORED)),
        lambda: run_all(worker.address, [second], max_new_tokens=4)))
    assert batches[0].snapshot and set(hashes_of(batches[:1], worker_pb2.KV_EVENT_KIND_STORED)) == set(stored)
    removed = hashes_of(batches[1:], worker_pb2.KV_EVENT_KIND_REMOVED)
    assert removed and set(removed) <= set(stored)  # the second prompt's pages evicted the first's
    evicted = worker.metric("pdserve:prefix_cache_evicted_pages_total")
    assert evicted >= len(removed)  # (a decode step may evict one more after the stream was read)
    assert_pages_idle(worker)


def test_cache_aware_gateway_routes_to_the_worker_holding_the_prefix(cluster: Cluster, tiny_model, tmp_path):
    # With a cluster secret: the gateway's event streams carry it like its other calls.
    cluster.env["PDSERVE_CLUSTER_SECRET"] = "kv-events-test-secret"
    (tmp_path / "secret").write_text("kv-events-test-secret")
    member = GrpcSecurity(cluster_secret_file=str(tmp_path / "secret"))
    bootstrap = cluster.bootstrap("--heartbeat-interval", "1")
    workers = cluster.start_many([
        (f"colocated-{i}", worker_args(tiny_model, "null", bootstrap=bootstrap, extra=("--num-pages", "256")))
        for i in range(2)])
    (gateway,) = cluster.start_many([("gateway", [
        "launch-router", "--model-path", str(tiny_model), "--port", "0", "--bootstrap", bootstrap.address,
        "--policy", "cache_aware"])])

    def views() -> dict[str, float]:
        samples = gateway.metrics()
        return {key: value for key, value in samples.items()
                if key.startswith("pdserve:gateway_worker_cached_pages")}

    wait_until(lambda: len(views()) == 2 and all(v == 0 for v in views().values()), 30,
               "the gateway to follow both workers' KV events")
    system, *questions = prompts_of([96, 9, 11, 13], seed=9)
    # Warm the worker the gateway would pick last (candidates go in address order, ties to the
    # first), behind its back: only the KV events can tell the gateway.
    holder, other = sorted(workers, key=lambda w: w.address, reverse=True)
    run_all(holder.address, [system + [5]], max_new_tokens=2, security=member)
    wait_until(lambda: sorted(views().values()) == [0, 6], 30, "the gateway to see the cached system prompt")
    for question in questions:
        reply = httpx.post(f"http://{gateway.address}/generate", timeout=60, json={
            "input_ids": system + question, "sampling_params": {"temperature": 0, "max_new_tokens": 4}})
        assert reply.status_code == 200, reply.text
    assert holder.metric("pdserve:prefix_cache_hit_tokens_total") == 6 * PAGE * len(questions)
    assert other.metric("pdserve:prefix_cache_query_tokens_total") == 0  # it got nothing
    assert_pages_idle(*workers)


def test_cache_aware_matches_prefill_and_decode_workers_on_their_own_caches(cluster: Cluster, tiny_model):
    bootstrap = cluster.bootstrap("--heartbeat-interval", "1")
    pool = ("--num-pages", "256")
    procs = cluster.start_many(
        [(f"prefill-{i}", worker_args(tiny_model, "prefill", backend="mooncake", bootstrap=bootstrap,
                                      extra=pool))
         for i in range(2)]
        + [(f"decode-{i}", worker_args(tiny_model, "decode", backend="mooncake", bootstrap=bootstrap,
                                       extra=pool))
           for i in range(2)])
    prefills, decodes = procs[:2], procs[2:]
    (gateway,) = cluster.start_many([("gateway", [
        "launch-router", "--model-path", str(tiny_model), "--port", "0", "--bootstrap", bootstrap.address,
        "--policy", "cache_aware"])])

    def views() -> list[float]:
        return [v for k, v in gateway.metrics().items()
                if k.startswith("pdserve:gateway_worker_cached_pages")]

    wait_until(lambda: views() == [0, 0, 0, 0], 30, "the gateway to follow all four workers' KV events")
    # Warm the prefill and the decode worker the gateway would pick last, as a pair, behind its back.
    last = lambda procs: max(procs, key=lambda p: p.address)  # noqa: E731
    prefill, decode = last(prefills), last(decodes)
    system, *questions = prompts_of([96, 9, 11], seed=19)
    run_all(decode.address, [system + [5]], [prefill.address], max_new_tokens=2)
    # Both now cache the prompt's 6 full pages (97 tokens + 2 generated: still 6 full pages on decode).
    wait_until(lambda: sorted(views()) == [0, 0, 6, 6], 30, "the gateway to see both caches")
    for question in questions:
        reply = httpx.post(f"http://{gateway.address}/generate", timeout=60, json={
            "input_ids": system + question, "sampling_params": {"temperature": 0, "max_new_tokens": 4}})
        assert reply.status_code == 200, reply.text
    assert prefill.metric("pdserve:prefix_cache_hit_tokens_total") == 6 * PAGE * len(questions)
    assert decode.metric("pdserve:prefix_cache_hit_tokens_total") == 6 * PAGE * len(questions)
    assert decode.metric("pdserve:kv_transfer_bytes_saved_total") > 0
    for other in (p for p in procs if p not in (prefill, decode)):
        assert other.metric("pdserve:prefix_cache_query_tokens_total") == 0, other.name
    assert_pages_idle(*procs)
