"""`pdserve bench registry-scale`: its defaults (the issue's fleet: 1000 workers at the default
heartbeat interval), and a small run end to end (long): every watcher sees a killed worker leave
within its lease plus a sweep."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve import envs
from tools.bench.registry_scale import add_arguments


def test_defaults_are_a_thousand_workers_at_the_default_interval():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    assert (args.workers, args.heartbeat_interval) == (1000, envs.HEARTBEAT_INTERVAL.get())


@pytest.mark.long
@pytest.mark.timeout(300)
def test_small_registry_run(tmp_path: Path):
    command = [sys.executable, "-m", "pdserve", "bench", "registry-scale", "--workers", "40",
               "--watchers", "2", "--window", "2", "--heartbeat-interval", "1",
               "--workdir", str(tmp_path), "--json"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    figures = json.loads(out.stdout[out.stdout.index("{"):])
    assert figures["lease_s"] == 2.0  # interval x the default 2 missed heartbeats
    assert figures["lease_s"] - 1.0 <= figures["killed_worker_left_every_view_s"] <= figures["lease_s"] + 2.0
    assert figures["registry_cpu_percent"] >= 0
