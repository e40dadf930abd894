"""The e2e tests' forked workers (tests/e2e/forked_launch.py) run as a fresh `python -m pdserve` would:
in the test's environment and directory at the time of the launch, not the fork server's."""

from __future__ import annotations

import pytest

from tests.e2e.cluster import Cluster, worker_args
from tests.e2e.forked_launch import ForkedLaunches, forkable

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SECRET_VAR = "PDSERVE_CLUSTER_SECRET"


def test_only_what_runs_the_same_forked_is_forked():
    worker = worker_args("model", "prefill")
    assert forkable(worker, None, (), "pdserve")
    assert forkable(worker, {SECRET_VAR: "s"}, (), "pdserve")  # pdserve reads it when the worker starts
    assert not forkable(worker, {"TRITON_INTERPRET": "1"}, (), "pdserve")  # a library may read it on import
    assert not forkable(worker, None, ("ip", "netns", "exec", "node1"), "pdserve")
    assert not forkable(worker, None, (), "tools.hooked_worker")
    assert not forkable(["bootstrap", "--port", "0"], None, (), "pdserve")


def test_a_forked_worker_runs_in_the_environment_and_directory_of_its_launch(
        cluster: Cluster, tiny_model, tmp_path, monkeypatch):
    # Each launch runs from a folder where only its relative --model-path exists, and the fork
    # server starts at the first (in that folder, with the variable set): the second worker finds its
    # model and runs unguarded only if it gets the test's directory and environment, not the server's.
    first, second = tmp_path / "first", tmp_path / "second"
    for folder, model in ((first, "model-a"), (second, "model-b")):
        folder.mkdir()
        (folder / model).symlink_to(tiny_model)
    launches = ForkedLaunches(tmp_path / "forks")
    try:
        monkeypatch.chdir(first)
        monkeypatch.setenv(SECRET_VAR, "a secret")
        guarded = launches.spawn("guarded", worker_args("model-a", "null"), tmp_path / "guarded.log")
        cluster.procs.append(guarded)
        monkeypatch.chdir(second)
        monkeypatch.delenv(SECRET_VAR)
        open_one = launches.spawn("open", worker_args("model-b", "null"), tmp_path / "open.log")
        cluster.procs.append(open_one)
        for worker in (guarded, open_one):
            worker.wait_ready(120)
        assert launches.forked == 2
        # The ready line says what guards the worker's gRPC: the variable as it was at each launch.
        assert "cluster secret" in guarded.log() and "no authentication" not in guarded.log()
        assert "no authentication" in open_one.log() and "cluster secret" not in open_one.log()
    finally:
        cluster.stop_all()
        launches.close()
