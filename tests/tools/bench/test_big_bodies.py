"""The big-bodies bench's reading of the worker's inter-token latency histogram
(tools/bench/big_bodies.py): a phase's own gaps, and those over 40 and 80 ms."""

from __future__ import annotations

import subprocess
import sys

from tools.bench.big_bodies import worker_gap_figures


def test_a_phase_counts_only_its_own_gaps_by_bucket():
    before = {"0.02": 90.0, "0.04": 95.0, "0.08": 99.0, "+Inf": 100.0}
    after = {"0.02": 290.0, "0.04": 380.0, "0.08": 396.0, "+Inf": 400.0}  # 300 gaps in the phase
    assert worker_gap_figures(before, after) == {"worker_gaps": 300, "worker_gaps_over_40ms": 15,
                                                 "worker_gaps_over_80ms": 3}


def test_a_worker_not_yet_exposing_the_histogram_counts_nothing():
    assert worker_gap_figures({}, {}) == {"worker_gaps": 0, "worker_gaps_over_40ms": 0,
                                          "worker_gaps_over_80ms": 0}


def test_the_big_body_clients_run_only_when_nothing_else_wants_the_cpu():
    # in a process of its own, as the bench's client process is: the policy is per process
    code = ("import os; from tools.bench.big_bodies import as_other_machines; as_other_machines(); "
            "print(os.sched_getscheduler(0) == os.SCHED_IDLE or os.nice(0) == 19)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "True", done.stderr
