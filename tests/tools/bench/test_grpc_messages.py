"""`pdserve bench grpc-messages` runs both deployments and accounts for every token it counted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.long
@pytest.mark.e2e
def test_messages_are_counted_for_pd_and_colocated(qwen3_ckpt: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "pdserve", "bench", "grpc-messages",
                             "--model-path", str(qwen3_ckpt), "--requests", "4", "--concurrency", "2",
                             "--max-tokens", "5", "--json"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout)
    for deployment in ("colocated", "pd"):
        counts = report[deployment]
        assert counts["tokens_per_request"] == 5
        assert 1 <= counts["stream_messages_per_request"] <= 5  # at least one message, at most one per token
    assert report["pd"]["other_messages_per_request"] == 2  # decode's Prefill call
