"""`pdserve bench registry-scale`: one registry (`pdserve bootstrap`, a real process) with many
workers heartbeating at the default interval and gateways watching, measured as a fleet sees it.

The workers are registry clients only (RegistryClient, as a worker's runtime uses it: register, then
a heartbeat every interval with its load), all in this process, so a thousand of them cost no model
or KV pool; the watchers are Watch streams, as each gateway opens one. It prints:

- the registry's CPU share while every worker heartbeats (its process's CPU seconds over
  `--window` seconds of steady state), against the same window with no worker registered (the
  baseline, measured first in the same run);
- how long registering all workers took, and how long each watcher took to see them all;
- after one worker stops heartbeating without deregistering (a killed worker), the time until every
  watcher saw it leave, against its lease (interval x max failures): the worst watcher's time must be
  within the lease plus one expiry sweep.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import psutil

from pdserve import envs
from protos.v1 import bootstrap_pb2, common_pb2
from services.common.registry_client import RegistryClient
from tests.services.bootstrap.workers import worker_info
from tools.launch import ProcessGroup

_JOINED, _LEFT = bootstrap_pb2.WORKER_EVENT_TYPE_JOINED, bootstrap_pb2.WORKER_EVENT_TYPE_LEFT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=1000, help="heartbeating workers")
    parser.add_argument("--watchers", type=int, default=4, help="Watch streams (one per gateway)")
    parser.add_argument("--window", type=float, default=20.0, help="seconds of steady state measured")
    parser.add_argument("--heartbeat-interval", type=float, default=envs.HEARTBEAT_INTERVAL.get(),
                        help="the registry's heartbeat interval (default: the default's)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/pdserve-bench-registry-scale"))
    parser.add_argument("--json", action="store_true")


class Watcher:
    """One gateway's view: the live worker ids, and when each left."""

    def __init__(self, address: str) -> None:
        self.client = RegistryClient(address)
        self.live: set[str] = set()
        self.left_at: dict[str, float] = {}
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for event in self.client.watch():
            if event.type == _JOINED:
                self.live.add(event.worker.worker_id)
            elif event.type == _LEFT:
                self.live.discard(event.worker.worker_id)
                self.left_at[event.worker.worker_id] = time.perf_counter()

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.client.close()


async def _until(condition, timeout_s: float, what: str) -> float:
    began = time.perf_counter()
    while not condition():
        if time.perf_counter() - began > timeout_s:
            raise SystemExit(f"bench registry-scale: timed out after {timeout_s:.0f}s waiting for {what}")
        await asyncio.sleep(0.05)
    return time.perf_counter() - began


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


async def measure(address: str, registry: psutil.Process, args: argparse.Namespace) -> dict:
    # baseline: the registry idle but for the watchers
    watchers = [Watcher(address) for _ in range(args.watchers)]
    await asyncio.sleep(1.0)
    cpu0 = _cpu(registry)
    await asyncio.sleep(args.window)
    idle_share = (_cpu(registry) - cpu0) / args.window

    clients = [RegistryClient(address) for _ in range(args.workers)]
    began = time.perf_counter()
    roles = (common_pb2.WORKER_ROLE_PREFILL, common_pb2.WORKER_ROLE_DECODE)
    for start in range(0, len(clients), 100):  # in waves, as a fleet's pods come up
        batch = list(enumerate(clients))[start:start + 100]
        await asyncio.gather(*(c.register(worker_info(f"10.0.{i // 250}.{i % 250}:30000", role=roles[i % 2]))
                               for i, c in batch))
        for _, client in batch:  # each heartbeats from its registration on, as a worker does
            client.start_heartbeat(load=lambda: common_pb2.WorkerLoad(running=1))
    registered = time.perf_counter() - began
    seen = [await _until(lambda w=w: len(w.live) >= args.workers, 120, "watchers to see every worker")
            for w in watchers]
    await asyncio.sleep(args.heartbeat_interval)  # heartbeats spread over the interval
    cpu0 = _cpu(registry)
    await asyncio.sleep(args.window)
    busy_share = (_cpu(registry) - cpu0) / args.window

    victim = clients[0]
    assert victim.worker_id is not None
    lease_s = victim.lease.ttl_seconds if victim.lease is not None and victim.lease.ttl_seconds else None
    await victim.stop_heartbeat()
    killed = time.perf_counter()
    await _until(lambda: all(victim.worker_id in w.left_at for w in watchers), 120,
                 "every watcher to see the killed worker leave")
    gone = [w.left_at[victim.worker_id] - killed for w in watchers]
    for client in clients[1:]:
        await client.stop_heartbeat()
    await asyncio.gather(*(c.close() for c in clients))
    await asyncio.gather(*(w.close() for w in watchers))
    return {"workers": args.workers, "watchers": args.watchers,
            "heartbeat_interval_s": args.heartbeat_interval,
            "registry_cpu_percent": round(100 * busy_share, 2),
            "registry_cpu_percent_baseline_no_workers": round(100 * idle_share, 2),
            "register_all_s": round(registered, 2), "watchers_saw_all_s": round(max(seen), 2),
            "lease_s": lease_s, "killed_worker_left_every_view_s": round(max(gone), 2)}


def main(args: argparse.Namespace) -> int:
    with ProcessGroup(args.workdir) as group:
        registry = group.start("bootstrap", ["bootstrap", "--port", "0", "--metrics-port", "0",
                                             "--heartbeat-interval", str(args.heartbeat_interval)])
        figures = asyncio.run(measure(registry.address, psutil.Process(registry.pid), args))
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        for key, value in figures.items():
            print(f"{key}: {value}")
    return 0
