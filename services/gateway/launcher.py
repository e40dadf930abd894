"""Start pdserve services as child processes and stop them cleanly (used by `pdserve up` and the
gateway benchmark).

Every pdserve service logs a ready line `... listening on HOST:PORT (metrics :MPORT) ...` once it
serves; `Child.wait_ready` reads the bound ports from it, so children can be started with port 0.
Children run in their own session: a Ctrl-C in the terminal reaches only the launcher, which then
stops them in order (SIGTERM, then SIGKILL after a grace period) instead of all dying at once.
Output goes to one log file per child.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

READY = re.compile(r"listening on (?P<host>[\w.\-\[\]:]+?):(?P<port>\d+) \(metrics :(?P<metrics>\d+)\)")


class ChildFailed(RuntimeError):
    """A child exited or did not become ready in time; the message carries its log tail."""


@dataclass
class Child:
    """One started pdserve service."""

    name: str
    popen: subprocess.Popen
    log_path: Path
    host: str = ""
    port: int = 0
    metrics_port: int = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Block until the ready line appears. Raises ChildFailed if the child exits or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not should_stop():
            match = READY.search(self.log_tail(1 << 20))
            if match:
                self.host, self.port, self.metrics_port = match["host"], int(match["port"]), int(match["metrics"])
                return
            if not self.alive():
                raise ChildFailed(f"{self.name} exited with code {self.popen.returncode}:\n{self.log_tail()}")
            time.sleep(0.1)
        if should_stop():
            raise ChildFailed(f"{self.name}: interrupted while starting")
        raise ChildFailed(f"{self.name} not ready within {timeout_s:.0f}s:\n{self.log_tail()}")


def start_child(name: str, pdserve_args: Sequence[str], log_dir: Path, env: dict[str, str] | None = None) -> Child:
    """`python -m pdserve ARGS` as a child in its own session, output to LOG_DIR/NAME.log."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    with open(log_path, "w") as log_file:
        popen = subprocess.Popen([sys.executable, "-m", "pdserve", *pdserve_args], stdout=log_file,
                                 stderr=subprocess.STDOUT, start_new_session=True,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    return Child(name, popen, log_path)


def stop_children(children: Sequence[Child], grace_s: float = 10.0,
                  report: Callable[[str], None] = lambda line: None) -> None:
    """SIGTERM each child in the given order (each gets up to `grace_s` to exit), SIGKILL the rest."""
    for child in children:
        if not child.alive():
            continue
        child.popen.send_signal(signal.SIGTERM)
        try:
            child.popen.wait(grace_s)
            report(f"stopped {child.name} (exit code {child.popen.returncode})")
        except subprocess.TimeoutExpired:
            child.popen.kill()
            child.popen.wait(5)
            report(f"killed {child.name}: it did not stop within {grace_s:.0f}s")
