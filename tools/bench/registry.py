"""Median latency of registry RPCs through a real `pdserve bootstrap` process, in-memory store vs
etcd store (a real etcd on free ports), with 50 workers registered. Run from the repo root:

    .venv/bin/python -m tools.bench.registry

docs/benchmarks-transfer-gateway-registry.md quotes its figures.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from protos.v1 import common_pb2
from services.common.registry_client import RegistryClient
from tests.services.bootstrap.etcd import run_etcd
from tests.services.bootstrap.process import start_bootstrap
from tests.services.bootstrap.workers import worker_info

WORKERS = 50
CALLS = 200


async def timed(call) -> float:
    start = time.perf_counter()
    await call
    return time.perf_counter() - start


async def measure(address: str) -> dict[str, str]:
    clients = [RegistryClient(address) for _ in range(WORKERS)]
    register = [await timed(c.register(worker_info(f"127.0.0.1:{20000 + i}"))) for i, c in enumerate(clients)]
    beating = clients[0]
    beating.start_heartbeat(load=lambda: common_pb2.WorkerLoad(running=1))
    await beating.stop_heartbeat()  # keeps the load probe; beats are driven by hand below
    same_load = [await timed(beating.heartbeat()) for _ in range(CALLS)]
    counter = iter(range(10**9))
    beating._load = lambda: common_pb2.WorkerLoad(running=next(counter))
    new_load = [await timed(beating.heartbeat()) for _ in range(CALLS)]
    listing = [await timed(beating.list()) for _ in range(CALLS // 4)]
    for client in clients:
        await client.close()

    def ms(samples: list[float]) -> str:
        return f"{statistics.median(samples) * 1000:.2f}"
    return {"register": ms(register), "heartbeat": ms(same_load), "heartbeat, load changed": ms(new_load),
            f"list {WORKERS}": ms(listing)}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, run_etcd(Path(tmp)) as etcd:
        for store, flags in [("memory", ()),
                             ("etcd", ("--registry-store", "etcd", "--etcd-endpoints", etcd.endpoint))]:
            registry = start_bootstrap("--heartbeat-interval", "30", *flags)
            try:
                print(f"{store:>6} store, median ms:", asyncio.run(measure(registry.address)))
            finally:
                registry.stop()


if __name__ == "__main__":
    main()
