"""schemathesis against the gateway's own OpenAPI document, with a real worker behind it.

A colocated worker (tiny model) and a gateway with an API key; schemathesis generates valid and
invalid requests for every operation from /openapi.json and runs every check it has: no 5xx,
declared statuses, media types, headers and response schemas only, valid bodies accepted,
invalid ones refused, the key enforced. The run is bounded by `--max-time` and `--max-examples`: a
short budget in `make test`, a longer one in `make test-all`; bodies are made cheap by
tests/e2e/schemathesis_hooks.py. The response time check keeps a generous limit: it catches a
hang, not a slow machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.cluster import Cluster, wait_until, worker_args

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-schemathesis"
# (seconds, examples per operation)
BUDGETS = [pytest.param((15, 8), id="short"), pytest.param((100, 50), id="long", marks=pytest.mark.long)]


@pytest.mark.parametrize("budget", BUDGETS)
def test_schemathesis_finds_nothing(cluster: Cluster, tiny_model: Path, tmp_path: Path,
                                    budget: tuple[int, int]) -> None:
    max_time_s, max_examples = budget
    worker = cluster.start("colocated", worker_args(str(tiny_model), "null"))
    gateway = cluster.start("gateway", ["launch-router", "--model-path", str(tiny_model), "--port", "0",
                                        "--worker", f"http://{worker.address}", "--api-key", KEY])
    wait_until(lambda: httpx.get(f"http://{gateway.address}/health", timeout=5).status_code == 200, 30,
               "the gateway to be ready")
    schemathesis = Path(sys.executable).with_name("schemathesis")
    command = [str(schemathesis), "run", f"http://{gateway.address}/openapi.json", "--checks", "all",
               "--max-response-time", "120", "--header", f"Authorization: Bearer {KEY}",
               "--max-time", str(max_time_s), "--max-examples", str(max_examples), "--request-timeout", "120",
               "--seed", "20261124", "--no-color", "--output-sanitize", "false"]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.e2e.schemathesis_hooks",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=max_time_s + 300)
    report = result.stdout[-20000:] + result.stderr[-4000:]
    assert result.returncode == 0, report
    assert "Tested: 7" in report, report  # every operation of the document was exercised
    assert "Traceback" not in gateway.log(), gateway.log()[-6000:]
