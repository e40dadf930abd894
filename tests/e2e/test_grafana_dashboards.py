"""Every Grafana dashboard panel's PromQL, run against a real Prometheus scraping a real system.

Grafana cannot be installed here; what it would show can still be checked. Registry, two prefill
workers and a decode worker (mooncake), all with the store tier on a mooncake_master, and a gateway
(given only the registry: it learns the model from the workers, as in deploy/k8s; round-robin, so a
repeated prompt reaches the prefill worker that did not compute it and is fetched from the store)
run as processes; Debian's Prometheus (scripts/setup.sh
installs it) scrapes them every second; after some traffic (chat and completion requests, one
request for an unknown model), every query of every panel in docker/grafana/dashboards/*.json is
run through Prometheus's HTTP API over the test's time range, as Grafana would run it. Each must
parse and return at least one series with a number in it: a misspelt metric or label, a metric a
service stopped exporting, or a broken expression fails the test.
"""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.cluster import Cluster, wait_until
from tests.engine.test_hicache import MASTER, Master

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

DASHBOARDS = Path(__file__).resolve().parents[2] / "docker" / "grafana" / "dashboards"
SCRAPE_INTERVAL_S = 1
# What Grafana puts in for its built-in variables at this scrape interval ($__rate_interval is at
# least four scrape intervals).
GRAFANA_VARIABLES = {"$__rate_interval": "10s", "$__interval": "2s", "$__range": "5m"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(model: Path, mode: str, bootstrap_address: str, store: str) -> list[str]:
    return ["launch-server", "--model-path", str(model), "--disaggregation-mode", mode, "--port", "0",
            "--metrics-port", "0", "--disaggregation-transfer-backend", "mooncake", "--num-threads", "1",
            "--num-pages", "128", "--bootstrap", bootstrap_address, "--enable-hierarchical-cache",
            "--hicache-mooncake-master", store, "--hicache-mooncake-segment-mb", "32"]


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, PromQL with Grafana's variables filled in) of every target."""
    queries = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                expr = target["expr"]
                for variable, value in GRAFANA_VARIABLES.items():
                    expr = expr.replace(variable, value)
                queries.append((path.name, panel["title"], expr))
    return queries


class Prometheus:
    """A real Prometheus on a free port, scraping `targets` every SCRAPE_INTERVAL_S."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.proc: subprocess.Popen | None = None

    def start(self, targets: dict[str, str]) -> None:
        jobs = [{"job_name": f"pdserve-{service}", "static_configs": [{"targets": [address],
                                                                        "labels": {"service": service}}]}
                for service, address in targets.items()]
        config = self.workdir / "prometheus.yml"
        config.write_text(json.dumps({"global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s"},
                                      "scrape_configs": jobs}))
        with open(self.workdir / "prometheus.log", "w") as log_file:
            self.proc = subprocess.Popen(
                [shutil.which("prometheus"), f"--config.file={config}",
                 f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                 f"--web.listen-address={self.url.removeprefix('http://')}"],
                stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        path = self.workdir / "prometheus.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Prometheus]:
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus is not installed (scripts/setup.sh installs Debian's `prometheus`)")
    workdir = tmp_path / "prometheus"
    workdir.mkdir()
    server = Prometheus(workdir)
    try:
        yield server
    finally:
        server.stop()


def _query_range(url: str, expr: str, start: float, end: float) -> dict:
    response = httpx.get(f"{url}/api/v1/query_range", timeout=10,
                         params={"query": expr, "start": start, "end": end, "step": SCRAPE_INTERVAL_S})
    return response.json()


@pytest.fixture
def master(tmp_path: Path) -> Iterator[Master]:
    if not MASTER.exists():
        pytest.skip("mooncake_master (the Mooncake wheel) is not installed")
    master = Master(tmp_path)
    yield master
    master.kill()


def test_every_dashboard_query_returns_data(cluster: Cluster, tiny_model: Path, prometheus: Prometheus,
                                            master: Master) -> None:
    url = prometheus.url
    queries = dashboard_queries()
    assert len(queries) >= 30 and {name for name, _, _ in queries} == {"gateway.json", "overview.json",
                                                                          "pd-pipeline.json"}
    bootstrap = cluster.bootstrap()
    prefill, prefill_2, decode = cluster.start_many([
        ("prefill", _worker(tiny_model, "prefill", bootstrap.address, master.address)),
        ("prefill-2", _worker(tiny_model, "prefill", bootstrap.address, master.address)),
        ("decode", _worker(tiny_model, "decode", bootstrap.address, master.address))])
    # as deploy/k8s runs it: no --model-path, the model is learned from the registry's workers
    gateway = cluster.start("gateway", ["launch-router", "--port", "0", "--bootstrap", bootstrap.address,
                                        "--policy", "round_robin"])
    wait_until(lambda: httpx.get(f"http://{gateway.address}/health", timeout=5).status_code == 200, 60,
               "the gateway to become healthy")
    targets = {"gateway": gateway.address, "bootstrap": f"{bootstrap.host}:{bootstrap.metrics_port}",
               "prefill": f"{prefill.host}:{prefill.metrics_port}",
               "decode": f"{decode.host}:{decode.metrics_port}",
               "prefill-2": f"{prefill_2.host}:{prefill_2.metrics_port}"}
    start = time.time()
    prometheus.start(targets)

    def targets_up() -> bool:
        try:
            active = httpx.get(f"{url}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
        except (httpx.HTTPError, ValueError):
            return False
        return len(active) == len(targets) and all(target["health"] == "up" for target in active)

    try:
        wait_until(targets_up, 60, "Prometheus to scrape all five services")
    except AssertionError:
        print(prometheus.log())
        raise

    client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    for index in range(6):
        chunks = client.chat.completions.create(
            model="tiny", max_tokens=16, temperature=0, stream=True,
            messages=[{"role": "user", "content": f"Tell me story {index}."}])
        assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        client.completions.create(model="tiny", prompt=f"Once upon a time {index}", max_tokens=8,
                                  temperature=0)
    # The store panels need a fetch: a prompt the other prefill worker wrote through, sent again.
    for worker in (prefill, prefill_2):
        wait_until(lambda worker=worker: worker.metric("pdserve:hicache_store_up") == 1, 60,
                   f"{worker.name}'s store")
    shared = [{"role": "user", "content": " ".join(f"shared prompt word {i}" for i in range(40))}]
    client.chat.completions.create(model="tiny", max_tokens=4, temperature=0, messages=shared)
    wait_until(lambda: prefill.metric("pdserve:hicache_written_pages_total")
               + prefill_2.metric("pdserve:hicache_written_pages_total") > 0, 60, "the write-through")
    client.chat.completions.create(model="tiny", max_tokens=4, temperature=0, messages=shared)
    assert (prefill.metric("pdserve:hicache_hit_pages_total")
            + prefill_2.metric("pdserve:hicache_hit_pages_total") > 0)
    with pytest.raises(openai.NotFoundError):  # the errors panels need an error
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)

    def scraped_all_traffic() -> bool:
        query = 'sum(pdserve:gateway_requests_total{endpoint=~".*completions"})'
        result = httpx.get(f"{url}/api/v1/query", timeout=5, params={"query": query}).json()["data"]["result"]
        return bool(result) and float(result[0]["value"][1]) >= 13
    wait_until(scraped_all_traffic, 30, "Prometheus to scrape the requests sent")
    time.sleep(3 * SCRAPE_INTERVAL_S)  # a few more scrapes, so every rate window has two samples
    end = time.time()

    failures = []
    for dashboard, title, expr in queries:
        answer = _query_range(url, expr, start, end)
        if answer.get("status") != "success":
            failures.append(f"{dashboard} / {title}: {expr}\n"
                            f"    {answer.get('errorType')}: {answer.get('error')}")
            continue
        values = [float(value) for series in answer["data"]["result"] for _, value in series["values"]]
        if not any(math.isfinite(value) for value in values):
            failures.append(f"{dashboard} / {title}: {expr}\n"
                            f"    no data ({len(answer['data']['result'])} series)")
    assert not failures, "panels whose query failed or returned nothing:\n" + "\n".join(failures)
