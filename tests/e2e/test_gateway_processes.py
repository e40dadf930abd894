"""`launch-router --workers 2`: two gateway processes on one port, each serving streams whole, and a
signal to the parent stops both gracefully. Behind them a simulated worker (--engine sim), whose
stream interval packs several tokens per message."""

from __future__ import annotations

import asyncio
import signal
import socket

import psutil
import pytest

from tests.e2e.cluster import Cluster, wait_until, worker_args
from tools.bench.sse_load import chat_body, run_load

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

NEW_TOKENS = 40


def test_two_gateway_processes_share_one_port(cluster: Cluster, tiny_model):
    worker = cluster.start("worker", worker_args(tiny_model, "null",
                                                 extra=("--engine", "sim", "--stream-interval", "4")))
    gateway = cluster.start("gateway", ["launch-router", "--worker", worker.address, "--port", "0",
                                        "--workers", "2"])
    processes = psutil.Process(gateway.pid).children()
    assert len(processes) == 2

    def listening(process: psutil.Process) -> bool:
        return any(c.laddr.port == gateway.port and c.status == psutil.CONN_LISTEN
                   for c in process.net_connections("tcp"))
    wait_until(lambda: all(listening(p) for p in processes), 60, "both gateway processes to listen")
    # connections are spread over the processes' sockets by a hash of their addresses: 24 reach both
    idle = [socket.create_connection((gateway.host, gateway.port)) for _ in range(24)]
    def accepted(process: psutil.Process) -> bool:
        return any(c.laddr.port == gateway.port and c.status == psutil.CONN_ESTABLISHED
                   for c in process.net_connections("tcp"))
    try:
        wait_until(lambda: all(accepted(p) for p in processes), 20, "each process to accept a connection")
    finally:
        for connection in idle:
            connection.close()
    timings = asyncio.run(run_load([f"http://{gateway.address}"], chat_body("tiny", "hi", NEW_TOKENS), 16,
                                   concurrency=16))
    assert [t.error for t in timings if t.error] == []
    assert all(t.tokens == NEW_TOKENS for t in timings)
    # 40 tokens at 4 per message after the first: 11 token events (with the role, finish and usage
    # events 14 at most), where one token per message would make over 40
    assert all(t.events <= 14 for t in timings), sorted(t.events for t in timings)
    gateway.send(signal.SIGTERM)
    assert gateway.popen.wait(30) == 0
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in processes)
