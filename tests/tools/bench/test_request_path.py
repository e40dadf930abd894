"""`pdserve bench request-path`: the tracer's argument handling, what counts, and one real run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench.call_tracer import service_argv
from tools.bench.request_path import REPO, classify

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_the_tracer_runs_what_follows_the_word_pdserve() -> None:
    assert service_argv(["/usr/bin/python3", "-m", "pdserve", "launch-server", "--port", "0"]) == \
        ["launch-server", "--port", "0"]
    assert service_argv(["pdserve", "bootstrap"]) == ["bootstrap"]
    with pytest.raises(SystemExit):
        service_argv(["launch-server"])


def test_only_deployed_hand_written_code_counts() -> None:
    assert classify(f"{REPO}/services/gateway/app.py") == "counted"
    assert classify(f"{REPO}/engine/scheduler.py") == "counted"
    assert classify(f"{REPO}/protos/v1/worker_pb2_grpc.py") == "generated"
    assert classify(f"{REPO}/engine/models/attention.py") == "forward"
    assert classify(f"{REPO}/kernels/ops.py") == "forward"
    assert classify(f"{REPO}/tools/bench/call_tracer.py") is None
    assert classify(f"{REPO}/.venv/lib/python3.11/site-packages/grpc/aio/_call.py") is None
    assert classify("/usr/lib/python3.11/asyncio/events.py") is None


@pytest.mark.long
@pytest.mark.e2e
def test_a_pd_chat_request_is_traced_through_every_process(qwen3_ckpt: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "pdserve", "bench", "request-path", "--model-path",
                             str(qwen3_ckpt), "--json", "--max-tokens", "4"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout)
    processes = report["processes"]
    assert any(path.startswith("services/gateway/") for path in processes["gateway"]["counted"])
    assert not any(path.startswith(("engine/", "libkv/")) for path in processes["gateway"]["counted"])
    assert any(path.startswith("services/decode/") for path in processes["decode"]["counted"])
    assert any(path.startswith("services/prefill/") for path in processes["prefill"]["counted"])
    assert processes["decode"]["forward"] and processes["prefill"]["forward"]  # both ran the model
    assert len(report["distinct_counted"]) >= len(processes["gateway"]["counted"])
