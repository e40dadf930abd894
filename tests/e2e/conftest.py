"""Shared fixtures of the end-to-end tests: the checkpoint and a cluster per test."""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

import tools.launch
from tests.e2e.cluster import Cluster
from tools.models.tiny_model import write_tiny_model


@pytest.fixture(scope="session", autouse=True)
def worker_flags(request) -> Iterator[tuple[str, ...]]:
    """`--worker-flags`: added to every worker (not an encoder, not DP attention) the tests start
    through the launcher, unless the test set that flag itself. Every module starts its processes through
    tools.launch.spawn, so one wrapper reaches them all (`pdserve up`'s children are its own)."""
    flags = tuple(shlex.split(request.config.getoption("--worker-flags")))
    if not flags:
        yield flags
        return
    plain_spawn = tools.launch.spawn
    names = {flag for flag in flags if flag.startswith("--")}

    def spawn_with_flags(name, args, log_path, **kwargs):
        args = list(args)
        # DP attention refuses speculative decoding at start (engine.config), so its workers run as given
        untouched = {"--encoder-only", "--enable-dp-attention", *names}
        if args[:1] == ["launch-server"] and not untouched & set(args):
            args += flags
        return plain_spawn(name, args, log_path, **kwargs)

    tools.launch.spawn = spawn_with_flags
    try:
        yield flags
    finally:
        tools.launch.spawn = plain_spawn


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
