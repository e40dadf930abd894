"""The gateway when workers or the registry misbehave (issue 8's findings 2, 5 and 6), real processes.

- A decode worker that freezes (SIGSTOP) while streaming: its lease expires and the gateway ends
  the open streams with an error instead of waiting forever; thawed, every page returns.
- A registry restart: the gateway keeps routing to the workers while they register again.
- Readiness: /health is 503 until a worker has actually answered, and 200 once one does.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest

from tests.e2e.cluster import Cluster, Proc, wait_until, worker_args
from tests.e2e.test_pd_services import assert_pages_idle

pytestmark = [pytest.mark.e2e, pytest.mark.alone, pytest.mark.timeout(300)]

BOUND_S = 30.0
FAST_LEASE = {"PDSERVE_DISAGGREGATION_HEARTBEAT_INTERVAL": "0.5",
              "PDSERVE_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2"}
MESSAGES = [{"role": "user", "content": "Tell me a long story about the river and the city."}]


def gateway_args(model, *extra: str) -> list[str]:
    return ["launch-router", "--model-path", str(model), "--port", "0", *extra]


def health(gateway: Proc) -> httpx.Response:
    return httpx.get(f"http://{gateway.address}/health", timeout=5)


def chat(gateway: Proc, max_tokens: int = 8, **extra) -> httpx.Response:
    return httpx.post(f"http://{gateway.address}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, **extra})


@dataclass
class StreamOutcome:
    chunks: int = 0
    error: dict | None = None
    done: bool = False
    started: threading.Event = field(default_factory=threading.Event)


def stream_chat(gateway: Proc, outcome: StreamOutcome) -> StreamOutcome:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 3500, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"http://{gateway.address}/v1/chat/completions", json=body,
                      timeout=httpx.Timeout(10, read=BOUND_S * 3)) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                outcome.done = True
                break
            payload = json.loads(line[len("data: "):])
            if "error" in payload:
                outcome.error = payload["error"]
                continue
            outcome.chunks += 1
            if outcome.chunks >= 3:
                outcome.started.set()
    return outcome


def test_frozen_decode_ends_its_open_streams(cluster: Cluster, tiny_model):
    """Finding 8.2: the streams on a SIGSTOPped decode end with an error soon after its lease expires."""
    cluster.env.update(FAST_LEASE)
    bootstrap = cluster.bootstrap()
    prefill, decode = cluster.start_many([
        ("prefill", worker_args(tiny_model, "prefill", backend="mooncake", bootstrap=bootstrap)),
        ("decode", worker_args(tiny_model, "decode", backend="mooncake", bootstrap=bootstrap))])
    gateway = cluster.start("gateway", gateway_args(tiny_model, "--bootstrap", bootstrap.address))
    wait_until(lambda: health(gateway).status_code == 200, BOUND_S, "the gateway to be ready")
    outcomes = [StreamOutcome() for _ in range(3)]
    try:
        with ThreadPoolExecutor(len(outcomes)) as pool:
            futures = [pool.submit(stream_chat, gateway, outcome) for outcome in outcomes]
            for outcome in outcomes:
                assert outcome.started.wait(BOUND_S), "streams did not start"
            decode.popen.send_signal(signal.SIGSTOP)
            stopped_at = time.monotonic()
            ended = [future.result(timeout=BOUND_S) for future in futures]
        assert time.monotonic() - stopped_at < BOUND_S
        for outcome in ended:
            assert outcome.error is not None, outcome  # an error event (then [DONE]), not a hang
            assert "stopped heartbeating" in outcome.error["message"], outcome.error
    finally:
        decode.popen.send_signal(signal.SIGCONT)
    # Thawed, the decode sees its calls cancelled: its pages and the prefill's return to idle, and
    # once it has registered again it serves.
    assert_pages_idle(decode, prefill, timeout_s=BOUND_S)
    wait_until(lambda: chat(gateway).status_code == 200, BOUND_S, "the thawed decode to serve again")


def test_registry_restart_keeps_workers_routable(cluster: Cluster, tiny_model):
    """Finding 8.5: after a registry restart the gateway does not drop workers that are alive.

    Heartbeats every 4 s: the restarted registry learns of the workers up to 4 s after it is back,
    while the gateway's watch reconnects sooner and sees it empty; requests must keep succeeding."""
    cluster.env.update(PDSERVE_DISAGGREGATION_HEARTBEAT_INTERVAL="4",
                       PDSERVE_DISAGGREGATION_HEARTBEAT_MAX_FAILURE="2")
    bootstrap = cluster.bootstrap()
    port = bootstrap.address.rsplit(":", 1)[1]
    cluster.start_many([
        ("prefill", worker_args(tiny_model, "prefill", backend="fake", bootstrap=bootstrap)),
        ("decode", worker_args(tiny_model, "decode", backend="fake", bootstrap=bootstrap))])
    gateway = cluster.start("gateway", gateway_args(tiny_model, "--bootstrap", bootstrap.address))
    wait_until(lambda: health(gateway).status_code == 200, BOUND_S, "the gateway to be ready")

    statuses: list[int] = []
    stop = threading.Event()

    def steady_load() -> None:
        while not stop.is_set():
            statuses.append(chat(gateway, max_tokens=2).status_code)
            time.sleep(0.05)

    with ThreadPoolExecutor(1) as pool:
        load = pool.submit(steady_load)
        bootstrap.kill(signal.SIGKILL)
        time.sleep(2)
        restarted = cluster.start("bootstrap-2", ["bootstrap", "--port", port, "--metrics-port", "0"])
        # Until every worker is back in the new registry, and a bit beyond.
        wait_until(lambda: restarted.metric("pdserve:bootstrap_workers") == 2, BOUND_S,
                   "workers to register with the restarted registry")
        time.sleep(2)
        stop.set()
        load.result(timeout=BOUND_S)
    assert statuses and set(statuses) == {200}, sorted(set(statuses))
    assert health(gateway).json()["workers"] == {"prefill": 1, "decode": 1, "colocated": 0}


def test_health_means_can_serve(cluster: Cluster, tiny_model):
    """Finding 8.6: a static worker that refuses connections does not make the gateway healthy."""
    probe = cluster.start("probe-worker", worker_args(tiny_model, "null"))
    address = probe.address
    probe.kill(signal.SIGKILL)  # the address now refuses connections
    gateway = cluster.start("gateway", gateway_args(tiny_model, "--worker", f"http://{address}"))
    for _ in range(10):
        response = health(gateway)
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "no_healthy_workers"
        time.sleep(0.2)
    # A worker comes up at that address: the gateway probes it and becomes ready.
    port = address.rsplit(":", 1)[1]
    args = worker_args(tiny_model, "null")
    args[args.index("--port") + 1] = port
    cluster.start("worker", args)
    wait_until(lambda: health(gateway).status_code == 200, BOUND_S, "the gateway to see the worker")
    assert chat(gateway).status_code == 200


def test_health_waits_for_the_registry_view(cluster: Cluster, tiny_model):
    """Not ready before the registry view is synced (here: the registry is not up yet)."""
    bootstrap = cluster.bootstrap()
    port = bootstrap.address.rsplit(":", 1)[1]
    bootstrap.kill(signal.SIGKILL)
    gateway = cluster.start("gateway", gateway_args(tiny_model, "--bootstrap", f"127.0.0.1:{port}"))
    response = health(gateway)
    assert response.status_code == 503 and "not synced" in response.json()["error"]["message"], response.text
    restarted = cluster.start("bootstrap-2", ["bootstrap", "--port", port, "--metrics-port", "0"])
    cluster.start("worker", worker_args(tiny_model, "null", bootstrap=restarted))
    wait_until(lambda: health(gateway).status_code == 200, BOUND_S, "the gateway to sync and see the worker")
