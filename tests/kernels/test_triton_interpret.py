"""Runs tests/kernels/triton_checks.py under TRITON_INTERPRET=1 in one subprocess; one test per case."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels.triton_checks import CASES

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, dict]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT),
           "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.triton_checks"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            results[row["case"]] = row
    if not results:
        pytest.fail(f"interpreter checks produced no results (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return results


@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_kernel_matches_torch_reference(interpreter_results, name):
    row = interpreter_results.get(name)
    assert row is not None, f"case {name} did not report (the subprocess died before it)"
    assert row["ok"], row["error"]
