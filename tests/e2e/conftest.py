"""Shared fixtures of the end-to-end tests: the checkpoint and a cluster per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import Cluster
from tools.models.tiny_model import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("e2e-model") / "tiny", preset="tiny", seed=0)


def leak_detections(cluster: Cluster) -> dict[str, float]:
    """Each live worker's `pdserve:kv_leak_detections_total` (the leak detector's firings)."""
    found = {}
    for proc in cluster.procs:
        if proc.alive() and proc.metrics_port:
            try:
                found[proc.name] = proc.metric("pdserve:kv_leak_detections_total")
            except OSError:
                continue  # stopped (SIGSTOP) or shutting down: nothing to read
    return found


@pytest.fixture
def cluster(tmp_path, request) -> Iterator[Cluster]:
    """Processes started by one test; killed after it, their logs printed if it failed. The test
    fails if any worker's leak detector fired."""
    with Cluster(tmp_path) as started:
        yield started
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            print(started.logs())
        leaks = {name: count for name, count in leak_detections(started).items() if count}
        if leaks:
            print(started.logs())
            pytest.fail(f"KV page leak detector fired: {leaks}")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.rep_call = report
    return report
