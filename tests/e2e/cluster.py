"""Real pdserve processes for end-to-end tests, on the launcher every tool uses (tools/launch.py):
every process binds 127.0.0.1 with port 0, its ports are read from its ready line, its output goes
to a log file that a failing test prints, and `Cluster` kills everything it started, whatever
happens in the test.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tools.launch import ProcessGroup, Service

Proc = Service  # the name the tests use


class Cluster(ProcessGroup):
    """The processes of one test, with short-hands for the services tests start most."""

    def bootstrap(self, *extra: str) -> Proc:
        return self.start("bootstrap", ["bootstrap", "--port", "0", "--metrics-port", "0", *extra])

    def worker(self, name: str, model: str, mode: str, *, backend: str = "fake",
               bootstrap: Proc | None = None, extra: tuple[str, ...] = ()) -> Proc:
        return self.start(name, worker_args(model, mode, backend=backend, bootstrap=bootstrap, extra=extra))


def worker_args(model: str, mode: str, *, backend: str = "fake", bootstrap: Proc | None = None,
                extra: tuple[str, ...] = ()) -> list[str]:
    """`pdserve launch-server` arguments for a test worker on free ports with one torch thread and a
    KV pool of 1024 pages (`extra` may say otherwise): sized from free memory it would take 2 GiB,
    whose zeroing alone took a second of every worker's start."""
    args = ["launch-server", "--model-path", str(model), "--disaggregation-mode", mode, "--port", "0",
            "--metrics-port", "0", "--disaggregation-transfer-backend", backend, "--num-threads", "1",
            "--num-pages", "1024", *extra]
    if bootstrap is not None:
        args += ["--bootstrap", bootstrap.address]
    return args


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `condition` every 0.1 s; fail the test naming `what` if it is not true within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


@dataclass
class UpRun:
    """A running `pdserve up`: what it printed until its ready line and the children it started."""

    popen: subprocess.Popen
    output: str = ""
    children: list[psutil.Process] = field(default_factory=list)

    def interrupt(self) -> str:
        """Ctrl-C; returns what `pdserve up` printed while it stopped (it has exited then)."""
        self.popen.send_signal(signal.SIGINT)
        rest, _ = self.popen.communicate(timeout=60)
        return rest


@contextmanager
def pdserve_up(args: Sequence[str], *, env: dict[str, str] | None = None,
               timeout_s: float = 240) -> Iterator[UpRun]:
    """`pdserve up ARGS` from the repository root, read until "Press Ctrl-C to stop." (or `timeout_s`);
    everything it started is killed when the block ends, whatever happened in it."""
    up = subprocess.Popen([sys.executable, "-m", "pdserve", "up", *args],
                          cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=env)
    run = UpRun(up)
    try:
        assert up.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + timeout_s
        for line in up.stdout:
            lines.append(line)
            if "Press Ctrl-C to stop." in line or time.monotonic() > deadline:
                break
        run.output = "".join(lines)
        run.children = psutil.Process(up.pid).children()
        yield run
    finally:
        for child in run.children:
            if child.is_running():
                child.kill()
        if up.poll() is None:
            up.kill()
            up.wait()
