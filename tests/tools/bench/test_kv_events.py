"""`pdserve bench kv-events` end to end, small: 4 simulated workers' KV event streams feed the
gateway's subscriptions and cache-aware policy; every pick goes to a worker caching the prompt's
prefix, and a view capped below what a worker caches holds exactly the cap."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def run(*extra: str) -> dict:
    command = [sys.executable, "-m", "pdserve", "bench", "kv-events", "--workers", "4",
               "--publisher-processes", "1", "--seconds", "2", "--decisions-per-s", "50", "--documents", "8",
               "--docs-per-worker", "2", "--json", *extra]
    out = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout[out.stdout.index("{"):])


def test_small_kv_event_fleet_routes_on_events_within_the_cap():
    figures = run()
    assert figures["workers"] == 4 and figures["routing_decision_ms"]["count"] > 0
    assert figures["routing_decision_ms"]["picked_a_worker_caching_the_prefix"] == 1.0
    assert figures["events_per_s"]["batches"] > 0 and figures["views"]["dropped_by_cap"] == 0
    # a cap below what each worker caches: the view holds exactly the cap, its earliest pages (the
    # hot prefixes of the snapshot) dropped first, so the picks no longer find them all
    capped = run("--view-max-pages", "300")
    assert capped["views"]["largest_pages"] == 300 and capped["views"]["dropped_by_cap"] > 0
    assert capped["routing_decision_ms"]["picked_a_worker_caching_the_prefix"] < 1.0
