"""Soak mode, shortened: `pdserve bench chaos --soak 30s --json` on one backend, faults drawn from the
quick scenarios (clients leaving, around the first token too, and the control), as an operator runs
it. The one row must show faults injected, load served, and no hung request, wrong answer, leaked
page or other problem; the command must end by itself (the subprocess timeout is far above its bound).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.test_chaos import _log_tails

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

SOAK = ["--backends", "mooncake", "--soak", "30s", "--soak-gap", "4", "--seed", "3",
        "--scenarios", "abort-window,disconnects,baseline", "--disconnects", "12", "--clients", "4",
        "--hung-after", "10", "--hung-wait", "10"]


def test_short_soak(tmp_path, tiny_model):
    log_dir = tmp_path / "logs"
    run = subprocess.run([sys.executable, "-m", "pdserve", "bench", "chaos", "--json", "--log-dir", str(log_dir),
                          "--model-path", str(tiny_model), *SOAK],
                         capture_output=True, text=True, timeout=360)
    try:
        (row,) = json.loads(run.stdout)
    except ValueError:
        pytest.fail(f"no JSON row from the soak (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}")
    if not row["ok"]:
        print(run.stderr[-8000:])
        print(_log_tails(log_dir))
    assert row["scenario"] == "soak" and row["backend"] == "mooncake"
    assert sum(row["faults"].values()) >= 2 and set(row["faults"]) <= {"abort-window", "disconnects", "baseline"}
    assert row["sent"] > 0 and row["succeeded"] == row["sent"]  # none of these faults may fail a request
    assert (row["hung"], row["wrong"], row["pages_leaked"]) == (0, 0, 0), row
    assert row["recovered"], row["not_recovered"]
    assert row["ok"], row["problems"]
    assert run.returncode == 0, run.stderr[-3000:]
