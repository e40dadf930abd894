"""Shared fixtures of the end-to-end tests: the checkpoint and a cluster per test."""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

import tools.launch
from tests.e2e.cluster import Cluster
from tests.e2e.forked_launch import ForkedLaunches
from tools.models.tiny_model import write_tiny_model

_launches: ForkedLaunches | None = None  # this pytest process's, while the session runs


@pytest.fixture(scope="session", autouse=True)
def forked_workers(request, tmp_path_factory) -> Iterator[ForkedLaunches | None]:
    """Workers forked from one fork server of this pytest process (tests/e2e/forked_launch.py), unless
    --fresh-workers; a test marked `fresh_workers` starts every process fresh."""
    global _launches
    if request.config.getoption("--fresh-workers"):
        yield None
        return
    _launches = ForkedLaunches(tmp_path_factory.mktemp("fork-server"))
    tools.launch.spawn = _launches.spawn
    try:
        yield _launches
    finally:
        tools.launch.spawn = _launches.plain_spawn
        _launches.close()
        _launches = None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Before the test's fixtures are set up, so a module's shared deployment follows its marker too.
    if _launches is not None:
        _launches.enabled = item.get_closest_marker("fresh_workers") is None


@pytest.fixture(scope="session", autouse=True)
def worker_flags(request, forked_workers) -> Iterator[tuple[str, ...]]:
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
