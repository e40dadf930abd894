"""`pdserve bench kv-events`: cache-aware routing fed by many workers' KV events at GPU rates.

Publishers: `--workers` simulated workers' KvEvents streams (pdserve.v1.KvEvents, real gRPC servers
on 127.0.0.1, spread over `--publisher-processes` processes). Each worker caches `--docs-per-worker`
hot documents (shared prefixes of `--doc-tokens` tokens, their real chained page hashes: sent in its
snapshot and kept, as LRU keeps hot prefixes) and, every `--step-ms` (a GPU step), stores the pages
its prefill made in that step (`--prefill-tokens-per-s`, default 40k: one H100's prefill rate; unique
prompt suffixes) and evicts the oldest beyond `--worker-pages` (its pool). The events go through the
worker's own subscription buffer: a batch per step while the gateway keeps up, everything that piled
up in one batch when it falls behind, at most one per `--batch-interval-ms` (the worker's
MIN_BATCH_INTERVAL_S), stamped with the worker's clock at its oldest event.

Subscriber: this process stands in for one gateway: the gateway's own WorkerPool,
KvEventSubscriptions (services/gateway/kv_events.py) and CacheAwarePolicy, on one event loop, each
worker's view capped at `--view-max-pages` (services/gateway/kv_view.py). While the events flow it
routes `--decisions-per-s` prompts (a hot document plus a unique suffix) over all workers and prints:
routing decision p50 / p99 (the policy's pick, hashing the prompt included; target p99 < 1 ms; wall
time, and the thread's CPU time, which leaves out the waits a loaded machine adds), the load average,
event lag p50 / p99 / max (target < 1 s), events applied per second, the largest view and the total
pages held (the bound), the gateway process's memory growth, and how often the pick was a worker
caching the prompt's document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import resource
import time
from collections import deque
from dataclasses import dataclass

import grpc
import psutil

from pdserve.page_hash import page_hashes
from protos.v1 import worker_pb2, worker_pb2_grpc
from services.gateway.kv_events import KvEventSubscriptions
from services.gateway.kv_view import MAX_VIEW_PAGES, KvCacheView
from services.gateway.policies.cache_aware import CacheAwarePolicy
from services.gateway.workers import WorkerPool
from services.worker.kv_events import _KINDS, DEVICE, MIN_BATCH_INTERVAL_S, _Subscription
from tools.bench.measures import cpu_seconds, percentile

PAGE = 16
STORED, REMOVED = worker_pb2.KV_EVENT_KIND_STORED, worker_pb2.KV_EVENT_KIND_REMOVED


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=64, help="simulated workers publishing KV events")
    parser.add_argument("--publisher-processes", type=int, default=2, help="processes serving them")
    parser.add_argument("--prefill-tokens-per-s", type=float, default=40_000.0,
                        help="prompt tokens each worker caches per second (new pages stored)")
    parser.add_argument("--step-ms", type=float, default=20.0, help="one batch of events per step")
    parser.add_argument("--batch-interval-ms", type=float, default=MIN_BATCH_INTERVAL_S * 1000,
                        help="at most one batch per this interval from each worker (the worker's own)")
    parser.add_argument("--worker-pages", type=int, default=32_768,
                        help="pages each worker's cache holds before it evicts (its pool)")
    parser.add_argument("--view-max-pages", type=int, default=MAX_VIEW_PAGES,
                        help="the gateway's cap on each worker's view")
    parser.add_argument("--documents", type=int, default=64, help="hot shared prefixes")
    parser.add_argument("--docs-per-worker", type=int, default=4, help="hot prefixes each worker caches")
    parser.add_argument("--doc-tokens", type=int, default=1024, help="tokens per hot prefix")
    parser.add_argument("--suffix-tokens", type=int, default=512, help="unique tokens after the prefix")
    parser.add_argument("--decisions-per-s", type=float, default=500.0, help="routing decisions per second")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured window")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


@dataclass(frozen=True)
class Workload:
    documents: list[list[int]]  # token ids of each hot prefix
    docs_per_worker: int
    suffix_tokens: int

    @classmethod
    def of(cls, args: argparse.Namespace) -> Workload:
        rng = random.Random(7)
        documents = [[rng.randrange(1, 30_000) for _ in range(args.doc_tokens)]
                     for _ in range(args.documents)]
        return cls(documents, args.docs_per_worker, args.suffix_tokens)

    def worker_documents(self, worker: int) -> list[int]:
        return [(worker + k * 17) % len(self.documents) for k in range(self.docs_per_worker)]


class SimulatedEvents(worker_pb2_grpc.KvEventsServicer):
    """One worker's KV events: the hot prefixes in the snapshot, then every step's stored and evicted
    pages handed to the worker's own subscription buffer (services/worker/kv_events.py), which sends
    whatever piled up as one batch whenever the stream can take it, as a worker does."""

    def __init__(self, worker: int, workload: Workload, args: argparse.Namespace) -> None:
        self.worker = worker
        self.snapshot = [h for d in workload.worker_documents(worker)
                         for h in page_hashes(workload.documents[d], PAGE)]
        self.pages_per_step = args.prefill_tokens_per_s * args.step_ms / 1000 / PAGE
        self.step_s = args.step_ms / 1000
        self.batch_interval_s = args.batch_interval_ms / 1000
        self.capacity = max(0, args.worker_pages - len(self.snapshot))

    async def _steps(self, subscription: _Subscription) -> None:
        rng = random.Random(self.worker)
        cached: deque[int] = deque()  # the unique pages, oldest first
        owed = 0.0
        next_step = time.monotonic()
        while True:
            next_step += self.step_s
            await asyncio.sleep(max(0.0, next_step - time.monotonic()))
            owed += self.pages_per_step
            count, owed = int(owed), owed - int(owed)
            stored = [rng.getrandbits(64) for _ in range(count)]
            cached.extend(stored)
            removed = [cached.popleft() for _ in range(max(0, len(cached) - self.capacity))]
            subscription.add("stored", DEVICE, stored)
            if removed:
                subscription.add("removed", DEVICE, removed)

    async def Subscribe(self, request, context):
        subscription = _Subscription(asyncio.get_running_loop(), max_pending=10_000_000)
        steps = asyncio.create_task(self._steps(subscription))
        try:
            yield worker_pb2.KvEventBatch(snapshot=True, page_size=PAGE, oldest_event_unix_s=time.time(),
                                          events=[worker_pb2.KvEvent(kind=STORED, page_hashes=self.snapshot)])
            while True:
                await subscription.ready.wait()
                events, oldest_at = subscription.take()
                if events:
                    yield worker_pb2.KvEventBatch(page_size=PAGE, oldest_event_unix_s=oldest_at, events=[
                        worker_pb2.KvEvent(kind=_KINDS[kind], medium=medium, page_hashes=hashes)
                        for kind, medium, hashes in events])
                    await asyncio.sleep(self.batch_interval_s)
        finally:
            steps.cancel()


def _publish(workers: list[int], args: argparse.Namespace, ports, stop) -> None:
    async def serve() -> None:
        workload = Workload.of(args)
        servers = []
        for worker in workers:
            server = grpc.aio.server()
            worker_pb2_grpc.add_KvEventsServicer_to_server(SimulatedEvents(worker, workload, args), server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            servers.append(server)
            ports.put((worker, port))
        while not stop.is_set():
            await asyncio.sleep(0.2)
        for server in servers:
            await server.stop(0)

    asyncio.run(serve())


async def _subscribe_and_route(ports: dict[int, int], args: argparse.Namespace,
                               publishers: list[psutil.Process]) -> dict:
    workload = Workload.of(args)
    pool = WorkerPool()
    holders: dict[int, set[str]] = {}
    for worker, port in sorted(ports.items()):
        handle = pool.add(f"127.0.0.1:{port}", "colocated", "sim", static=True, page_size=PAGE)
        handle.kv_cache = KvCacheView(max_pages=args.view_max_pages)
        for document in workload.worker_documents(worker):
            holders.setdefault(document, set()).add(handle.address)
    lags: list[float] = []
    subscriptions = KvEventSubscriptions(pool, on_lag=lags.append)
    subscriptions.start()
    candidates = pool.all()
    deadline = time.monotonic() + 60
    while not all(w.kv_cache.synced for w in candidates):
        if time.monotonic() > deadline:
            raise SystemExit("bench kv-events: not every worker's snapshot arrived within 60 s")
        await asyncio.sleep(0.1)
    await asyncio.sleep(2.0)  # warm-up: the streams reach their steady rate
    policy = CacheAwarePolicy()
    rng = random.Random(11)
    held = sorted(holders)
    lags.clear()
    me = psutil.Process()
    rss0, cpu0 = me.memory_info().rss, me.cpu_times()
    publishers_cpu0 = sum(cpu_seconds(p) for p in publishers)
    decisions: list[float] = []
    decisions_cpu: list[float] = []  # the pick's own work: on a loaded machine the wall p99 is mostly waits
    load_before = os.getloadavg()[0]
    hits = 0
    began = time.monotonic()
    largest_view = 0
    interval = 1.0 / args.decisions_per_s
    next_at = began
    while time.monotonic() - began < args.seconds:
        next_at += interval
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        document = rng.choice(held)  # a prefix some worker caches
        suffix = [rng.randrange(1, 30_000) for _ in range(workload.suffix_tokens)]
        prompt = workload.documents[document] + suffix
        start, start_cpu = time.perf_counter(), time.thread_time()
        chosen = policy.choose(candidates, prompt)
        decisions.append(time.perf_counter() - start)
        decisions_cpu.append(time.thread_time() - start_cpu)
        hits += chosen.address in holders.get(document, ())
        if len(decisions) % 200 == 0:
            largest_view = max(largest_view, max(len(w.kv_cache.hashes) for w in candidates))
    wall = time.monotonic() - began
    cpu1 = me.cpu_times()
    publishers_cpu_s = sum(cpu_seconds(p) for p in publishers) - publishers_cpu0
    views = [len(w.kv_cache.hashes) for w in candidates]
    largest_view = max(largest_view, *views)
    dropped = sum(w.kv_cache.hashes.dropped for w in candidates)
    hit_share = hits / max(1, len(decisions))
    cpu_s = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    await subscriptions.close()
    for worker in candidates:
        pool.remove(worker.address)
    ms = 1000.0
    return {
        "workers": len(candidates), "seconds": round(wall, 1),
        "events_per_s": {"batches": round(len(lags) / wall), "stored_pages_per_worker":
                         round(args.prefill_tokens_per_s / PAGE)},
        "routing_decision_ms": {"p50": round(ms * (percentile(decisions, 0.5) or 0), 4),
                                "p99": round(ms * (percentile(decisions, 0.99) or 0), 4),
                                "max": round(ms * max(decisions), 3), "count": len(decisions),
                                "cpu_p50": round(ms * (percentile(decisions_cpu, 0.5) or 0), 4),
                                "cpu_p99": round(ms * (percentile(decisions_cpu, 0.99) or 0), 4),
                                "picked_a_worker_caching_the_prefix": round(hit_share, 3)},
        "event_lag_ms": {"p50": round(ms * (percentile(lags, 0.5) or 0), 2),
                         "p99": round(ms * (percentile(lags, 0.99) or 0), 2),
                         "max": round(ms * max(lags, default=0), 2)},
        "views": {"cap_pages_per_worker": args.view_max_pages, "largest_pages": largest_view,
                  "total_pages": sum(views), "dropped_by_cap": dropped,
                  "rss_growth_mb": round((me.memory_info().rss - rss0) / 1e6, 1),
                  "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3, 1)},
        "subscriber_cpu_percent": round(100 * cpu_s / wall, 1),
        # the workers' side, on this same machine here (a worker's own process in a deployment): when
        # these and the subscriber share too few cores, the lag is theirs as much as the gateway's
        "publishers_cpu_percent": round(100 * publishers_cpu_s / wall, 1),
        "machine_cpu_percent": psutil.cpu_percent(),
        "load_average_1m": {"before": round(load_before, 1), "after": round(os.getloadavg()[0], 1),
                            "cpus": os.cpu_count()},
    }


def run(args: argparse.Namespace) -> dict:
    context = multiprocessing.get_context("spawn")
    ports_queue, stop = context.Queue(), context.Event()
    shares = [list(range(args.workers))[i::args.publisher_processes] for i in range(args.publisher_processes)]
    publishers = [context.Process(target=_publish, args=(share, args, ports_queue, stop), daemon=True)
                  for share in shares if share]
    for process in publishers:
        process.start()
    try:
        ports = dict(ports_queue.get(timeout=120) for _ in range(args.workers))
        psutil.cpu_percent()
        return asyncio.run(_subscribe_and_route(ports, args, [psutil.Process(p.pid) for p in publishers]))
    finally:
        stop.set()
        for process in publishers:
            process.join(10)
            if process.is_alive():
                process.kill()


def main(args: argparse.Namespace) -> int:
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for section, values in report.items():
            shown = ", ".join(f"{k}={v}" for k, v in values.items()) if isinstance(values, dict) else values
            print(f"{section}: {shown}")
    return 0
