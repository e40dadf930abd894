"""Shared fixtures of the end-to-end tests: the checkpoint and a cluster per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.tiny_model import write_tiny_model
from tests.e2e.cluster import Cluster


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("e2e-model") / "tiny", preset="tiny", seed=0)


@pytest.fixture
def cluster(tmp_path, request) -> Iterator[Cluster]:
    """Processes started by one test; killed after it, their logs printed if it failed."""
    with Cluster(tmp_path) as started:
        yield started
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            print(started.logs())


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.rep_call = report
    return report
