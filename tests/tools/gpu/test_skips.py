"""Without CUDA every part of the GPU suite skips, printing its reason, loading no model; the
suite runner's table reads those reasons. (On a GPU machine these checks have nothing to check.)"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tools.gpu.plan import PARTS, REPO
from tools.gpu.suite import Row, row_from_junit, run_bench, summary

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: the GPU suite runs instead")


def test_every_part_skips_with_its_reason(tmp_path):
    junit = tmp_path / "gpu.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           f"--junitxml={junit}", "tests/gpu"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 5, proc.stdout + proc.stderr  # pytest's "no tests ran": every module skipped
    test_parts = [part.name for part in PARTS if part.paths]
    for name in test_parts:
        assert f"[gpu:{name}] no CUDA: torch.cuda.is_available() is False" in proc.stdout, proc.stdout
    row = row_from_junit("all", junit, proc.returncode)
    assert (row.passed, row.failed, row.skipped) == (0, 0, len(test_parts))
    assert row.reason.startswith("[gpu:") and "no CUDA" in row.reason


def test_a_run_with_no_report_or_a_collection_error_counts_as_failed(tmp_path):
    assert row_from_junit("pd", tmp_path / "absent.xml", 4).failed == 1
    junit = tmp_path / "empty.xml"
    junit.write_text('<testsuites><testsuite name="pytest" tests="0"></testsuite></testsuites>')
    row = row_from_junit("pd", junit, 2)
    assert (row.failed, row.reason) == (1, "pytest exited 2")


def test_bench_skips_without_cuda_and_the_table_shows_it(tmp_path):
    row = run_bench(tmp_path, peer_python=None)
    assert (row.skipped, row.failed) == (1, 0) and "[gpu:bench] no CUDA" in row.reason
    table = summary([row, Row("tp", passed=1, seconds=12.0)])
    assert table.splitlines()[0].split() == ["part", "passed", "failed", "skipped", "time", "reason", "/",
                                             "result"]
    assert "[gpu:bench] no CUDA" in table and "tp            1      0       0     12s" in table
