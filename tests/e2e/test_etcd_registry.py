"""Two registry processes on one real etcd, as real processes: etcd + 2 registries + prefill + decode
(mooncake) + gateway, every client given both registry addresses. Killing one registry with
SIGKILL under load loses no request and no worker: the workers heartbeat the same etcd leases
through the other registry and keep their ids, and the gateway's watch moves there without
seeing anyone leave. And `pdserve up` runs two registries on etcd. Skipped, saying why, only when no
etcd binary is installed.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from services.common.registry_client import RegistryClient
from services.common.security import GrpcSecurity
from tests.e2e.cluster import Cluster, Proc, pdserve_up, wait_until
from tests.services.bootstrap.etcd import run_etcd

pytestmark = [pytest.mark.e2e, pytest.mark.alone, pytest.mark.timeout(300)]

BACKEND = "mooncake"
PROMPTS = ["The history of the city begins", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The river runs"]
TWO_WORKERS = {"prefill": 1, "decode": 1, "colocated": 0}


def registry_args(etcd_endpoint: str) -> tuple[str, ...]:
    # lease 0.5 s x 6 = 3 s: several heartbeats of slack on a busy machine
    return ("--registry-store", "etcd", "--etcd-endpoints", etcd_endpoint, "--etcd-cluster", "e2e",
            "--heartbeat-interval", "0.5", "--heartbeat-max-failure", "6")


def worker_args(model: Path, mode: str, registries: str) -> list[str]:
    return ["launch-server", "--model-path", str(model), "--disaggregation-mode", mode, "--port", "0",
            "--metrics-port", "0", "--disaggregation-transfer-backend", BACKEND, "--num-threads", "1",
            "--num-pages", "256", "--bootstrap", registries]


def registered(address: str, secret_file: Path | None = None) -> dict[str, str]:
    """worker id -> grpc address, as one registry lists them."""
    async def ask() -> dict[str, str]:
        security = GrpcSecurity(cluster_secret_file=str(secret_file)) if secret_file else None
        client = RegistryClient(address, security=security)
        try:
            return {info.worker_id: info.grpc_address for info in await client.list()}
        finally:
            await client.close()
    return asyncio.run(ask())


def test_killing_one_of_two_registries_under_load_loses_no_worker_and_no_request(
        cluster: Cluster, tiny_model: Path, tmp_path: Path) -> None:
    (tmp_path / "etcd").mkdir()
    with run_etcd(tmp_path / "etcd") as etcd:
        try:
            check_failover(cluster, tiny_model, etcd.endpoint)
        finally:
            cluster.stop_all()  # before etcd goes: workers deregister through a registry that works


def check_failover(cluster: Cluster, tiny_model: Path, etcd_endpoint: str) -> None:
    """The whole scenario (see the module docstring), on an etcd that outlives every process."""
    first = cluster.bootstrap(*registry_args(etcd_endpoint))
    second = cluster.bootstrap(*registry_args(etcd_endpoint))
    registries = f"{first.address},{second.address}"  # every client starts on `first`
    prefill, decode = cluster.start_many([("prefill", worker_args(tiny_model, "prefill", registries)),
                                          ("decode", worker_args(tiny_model, "decode", registries))], 180)
    gateway: Proc = cluster.start("gateway", ["launch-router", "--model-path", str(tiny_model), "--port", "0",
                                              "--bootstrap", registries])

    def gateway_workers() -> dict:
        return httpx.get(f"http://{gateway.address}/health", timeout=5).json().get("workers")

    wait_until(lambda: gateway_workers() == TWO_WORKERS, 60, "the gateway to see 1 prefill and 1 decode")
    # the same view through either registry
    before = registered(first.address)
    assert registered(second.address) == before
    assert sorted(before.values()) == sorted([prefill.address, decode.address])

    client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", max_retries=0,
                           timeout=120)

    def ask(index: int) -> tuple[int, str]:
        prompt = PROMPTS[index % len(PROMPTS)]
        return index, client.completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                                temperature=0).choices[0].text

    reference = dict(ask(i) for i in range(len(PROMPTS)))

    # the gateway's view, sampled all through the load and the kill
    views: list[dict] = []
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            views.append(gateway_workers())
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        with ThreadPoolExecutor(max_workers=6) as pool:
            futures = [pool.submit(ask, i) for i in range(24)]
            wait_until(lambda: sum(f.done() for f in futures) >= 4, 60, "the load to get going")
            first.kill(signal.SIGKILL)
            futures += [pool.submit(ask, i) for i in range(24, 48)]
            answers = [future.result() for future in futures]  # any client-visible error raises here
        # two lease lifetimes with `first` dead: heartbeats must have been going through `second`
        time.sleep(6.5)
        views.append(gateway_workers())
    finally:
        sampling.set()
        sampler.join(10)

    assert all(text == reference[index % len(PROMPTS)] for index, text in answers)
    assert len(views) > 20 and all(view == TWO_WORKERS for view in views), \
        [view for view in views if view != TWO_WORKERS][:5]
    # same workers, same ids: nobody's lease ran out and nobody registered again
    assert registered(second.address) == before
    for worker in (prefill, decode):
        assert "registering again" not in worker.log()
        assert "switching to" in worker.log()  # it did fail over to `second`
    assert "switching to" in gateway.log()
    assert second.metric("pdserve:bootstrap_lease_expiries_total") == 0

    # and the survivor still admits workers: a second decode joins the gateway's view
    cluster.start("decode-2", worker_args(tiny_model, "decode", registries))
    wait_until(lambda: gateway_workers() == {"prefill": 1, "decode": 2, "colocated": 0}, 60,
               "the gateway to see the new decode worker")
    assert len(registered(second.address)) == 3
    assert ask(0)[1] == reference[0]


def test_up_runs_two_registries_on_etcd(tiny_model: Path, tmp_path: Path) -> None:
    """`pdserve up --etcd-endpoints URL --num-registries 2`: both registries on etcd, workers and the
    gateway given both, a request served, and Ctrl-C stops all five children."""
    (tmp_path / "etcd").mkdir()
    secret_file = tmp_path / "secret"
    secret_file.write_text("etcd-up-test-secret")
    with run_etcd(tmp_path / "etcd") as etcd:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        args = ["--model-path", str(tiny_model), "--port", str(port), "--transfer-backend", BACKEND,
                "--worker-threads", "1", "--log-dir", str(tmp_path / "logs"),
                "--etcd-endpoints", etcd.endpoint, "--num-registries", "2"]
        with pdserve_up(args, env={**os.environ, "PDSERVE_CLUSTER_SECRET": secret_file.read_text()}) as up:
            output = up.output
            assert "Press Ctrl-C to stop." in output, output
            assert output.count("registry on etcd") == 2, output
            assert len(up.children) == 5  # 2 registries, prefill, decode, gateway
            registries = re.findall(r"bootstrap-\d ready on (\S+)", output)
            views = [registered(address, secret_file) for address in registries]
            assert len(views) == 2 and views[0] == views[1] and len(views[0]) == 2
            answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                                json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4})
            assert answer.status_code == 200, answer.text
            rest = up.interrupt()
            assert up.popen.returncode == 0, output + rest
            assert rest.count("stopped ") == 5 and "killed" not in rest, rest
