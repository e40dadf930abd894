"""`pdserve bench fleet`: its histogram reading (routing decision percentiles from the gateways'
buckets), and one small run end to end (long: 2 + 2 simulated workers, one gateway)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench.fleet import _histogram_quantile, add_arguments

NAME = "pdserve:gateway_routing_decision_seconds"


def buckets(counts: dict[str, float]) -> dict[str, float]:
    return {f'{NAME}_bucket{{le="{edge}"}}': count for edge, count in counts.items()}


def test_histogram_quantile_interpolates_within_the_bucket():
    samples = buckets({"0.0001": 50, "0.001": 90, "0.01": 100, "+Inf": 100})
    assert _histogram_quantile(samples, NAME, 0.5) == pytest.approx(0.0001)
    assert _histogram_quantile(samples, NAME, 0.7) == pytest.approx(0.0001 + 0.0009 * 0.5)
    assert _histogram_quantile(samples, NAME, 0.99) == pytest.approx(0.001 + 0.009 * 0.9)
    assert _histogram_quantile({}, NAME, 0.5) is None
    # past the last finite bucket: its edge (a lower bound)
    assert _histogram_quantile(buckets({"0.01": 1, "+Inf": 10}), NAME, 0.99) == pytest.approx(0.01)


def test_arguments_default_to_a_small_fleet():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    assert (args.prefill, args.decode, args.gateways, args.stream_interval) == (2, 2, 1, 1)
    assert args.baseline_stream_interval is None
    assert args.fork_workers and not parser.parse_args(["--no-fork-workers"]).fork_workers


@pytest.mark.long
@pytest.mark.timeout(600)
def test_small_fleet_runs_with_no_errors(tmp_path: Path, qwen3_ckpt: Path):
    command = [sys.executable, "-m", "pdserve", "bench", "fleet", "--model-path", str(qwen3_ckpt),
               "--requests", "24", "--rate", "8", "--output-len", "32", "--stream-interval", "4",
               "--workdir", str(tmp_path), "--json"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    figures = json.loads(out.stdout[out.stdout.index("{"):])["measured"]
    assert figures["load"]["errors"] == 0
    assert figures["load"]["output_tokens"] == 24 * 32
    assert figures["gateway"]["cpu_ms_per_token"] > 0
    assert figures["routing_decision_ms"]["count"] == 24
    # forked from the fork server (tools/worker_forks.py): far below a worker started alone (200-290 MB)
    costs = figures["worker_costs"]
    assert costs["forked"] and 0 < costs["uss_max_mib"] < 120
    assert costs["load_cores"] > 0 and costs["cpu_ms_per_token"] > 0
