"""`pdserve up` brings the whole system up as child processes, serves, and stops all of it on
Ctrl-C; `pdserve bench gateway --json` runs and prints its figures."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from tests.e2e.cluster import pdserve_up

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tools.models.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny", preset="tiny", seed=0)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_up_serves_and_stops_everything_on_ctrl_c(model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    with pdserve_up(["--model-path", str(model_dir), "--port", str(port), "--num-prefill", "1",
                     "--num-decode", "1", "--log-dir", str(tmp_path / "logs"),
                     "--worker-threads", "1"]) as up:
        output = up.output
        assert "Press Ctrl-C to stop." in output, output
        curl = re.search(r"curl (\S+) -H 'Content-Type: application/json' -d '(.+)'", output)
        assert curl, output
        children = up.children
        assert len(children) == 4  # bootstrap, prefill, decode, gateway
        answer = httpx.post(curl.group(1), json=json.loads(curl.group(2)), timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 32
        rest = up.interrupt()
        assert up.popen.returncode == 0, output + rest
        assert rest.count("stopped ") == 4 and "killed" not in rest, rest
        assert not any(child.is_running() and child.status() != psutil.STATUS_ZOMBIE for child in children)


def test_bench_gateway_prints_json(model_dir: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "pdserve", "bench", "gateway", "--json", "--model-path",
                             str(model_dir), "--requests", "10", "--concurrency", "2"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["requests"] == 10 and figures["max_tokens"] == 4
    for way in ("direct", "gateway"):
        assert figures[way]["p50_ms"] > 0 and figures[way]["requests_per_s"] > 0
    assert set(figures["added_latency_ms"]) == {"p50", "p99"}
