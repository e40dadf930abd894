"""pdserve services as real child processes: start, read the ready line, signal, scrape, stop.

Every pdserve service logs a ready line `... listening on HOST:PORT (metrics :MPORT) ...` once it
serves; `Service.wait_ready` reads the bound ports from it, so services can be started on port 0.
Output goes to one log file per process. Children run in their own session (a Ctrl-C in the terminal
reaches only the parent, which then stops them) and get SIGKILL if the parent dies without cleaning
up (PR_SET_PDEATHSIG). `ProcessGroup` kills everything it started when its `with` block ends,
whatever happened inside it: the chaos suite and the e2e tests share this code.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from services.chaos.metrics import scrape, sum_samples

READY = re.compile(r"listening on (?P<host>[\w.\-\[\]:]+?):(?P<port>\d+) \(metrics :(?P<metrics>\d+)\)")

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: SIGKILL it when the parent goes away, so a harness
    killed with -9 leaves no orphans behind. Linux only; elsewhere it is skipped."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


class NotReady(RuntimeError):
    """A service exited or did not log its ready line in time; the message carries its log tail."""


@dataclass
class Service:
    """One started pdserve process. `address` is its gRPC (or HTTP, for the gateway) host:port once
    ready; `metrics_port` serves /metrics on the same host. `args` and `wrapper` (a command the
    process runs under, e.g. `ip netns exec NS`) are kept so the service can be started again."""

    name: str
    args: list[str]
    popen: subprocess.Popen
    log_path: Path
    wrapper: tuple[str, ...] = ()
    host: str = ""
    port: int = 0
    metrics_port: int = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def send(self, sig: int) -> None:
        """Deliver `sig` if the process still runs (SIGSTOP/SIGCONT freeze and thaw it)."""
        if self.alive():
            self.popen.send_signal(sig)

    def kill(self, sig: int = signal.SIGKILL, wait_s: float = 15.0) -> None:
        """Send `sig` and wait for the exit; SIGKILL if it outlives `wait_s`. A stopped process is
        continued first, or it could not act on a SIGTERM."""
        if not self.alive():
            return
        self.popen.send_signal(sig)
        if sig not in (signal.SIGKILL, signal.SIGCONT):
            self.popen.send_signal(signal.SIGCONT)
        try:
            self.popen.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=5)

    def poll_ready(self) -> bool:
        """True once the ready line is in the log (the bound ports are then read from it). Raises
        NotReady if the process exited before it. Never blocks, so asyncio callers can poll it."""
        if self.port:
            return True
        match = READY.search(self.log())
        if match:
            self.host, self.port, self.metrics_port = match["host"], int(match["port"]), int(match["metrics"])
            return True
        if not self.alive():
            raise NotReady(f"{self.name} exited with {self.popen.returncode}:\n{self.log()[-6000:]}")
        return False

    def not_ready(self, why: str) -> NotReady:
        """Kill the process (it failed to come up) and describe why, with its log tail."""
        self.kill()
        return NotReady(f"{self.name} {why}:\n{self.log()[-6000:]}")

    def wait_ready(self, timeout_s: float = 180.0) -> Service:
        """Block until the ready line appears and read the bound ports from it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.poll_ready():
                return self
            time.sleep(0.1)
        raise self.not_ready(f"not ready within {timeout_s:.0f}s")

    def metrics(self, timeout_s: float = 5.0) -> dict[str, float]:
        """The /metrics samples, keyed `name{labels}` as exposed."""
        return scrape(f"http://{self.host}:{self.metrics_port}/metrics", timeout_s)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (0 if none)."""
        return sum_samples(self.metrics(), name, **labels) or 0.0


@dataclass
class ProcessGroup:
    """The processes of one run. Use as a context manager: everything is stopped on exit.
    `env` is added to every child's environment (after os.environ)."""

    workdir: Path
    env: dict[str, str] = field(default_factory=dict)
    procs: list[Service] = field(default_factory=list)

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop_all()

    def stop_all(self, grace_s: float = 10.0) -> None:
        """SIGTERM the live processes, newest first (the gateway before workers before the registry)."""
        for proc in reversed(self.procs):
            proc.kill(signal.SIGTERM, wait_s=grace_s)

    def spawn(self, name: str, args: Sequence[str], *, wrapper: Sequence[str] = ()) -> Service:
        """Start `pdserve ARGS` (under `wrapper`, if any) without waiting for it to be ready. A name
        used before gets a numbered log file, so the log of a killed process is kept."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        earlier = sum(1 for proc in self.procs if proc.name == name)
        log_path = self.workdir / (f"{name}.log" if not earlier else f"{name}.{earlier}.log")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PDSERVE_LOG_LEVEL": "INFO", **self.env}
        with open(log_path, "w") as log_file:
            popen = subprocess.Popen([*wrapper, sys.executable, "-m", "pdserve", *args], stdout=log_file,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        proc = Service(name, list(args), popen, log_path, tuple(wrapper))
        self.procs.append(proc)
        return proc

    def start(self, name: str, args: Sequence[str], *, wrapper: Sequence[str] = (),
              timeout_s: float = 180.0) -> Service:
        return self.spawn(name, args, wrapper=wrapper).wait_ready(timeout_s)

    def start_many(self, specs: Sequence[tuple[str, Sequence[str]]], timeout_s: float = 180.0) -> list[Service]:
        """Start several services at once (their model loading overlaps), then wait for each."""
        procs = [self.spawn(name, args) for name, args in specs]
        return [proc.wait_ready(timeout_s) for proc in procs]

    def restart(self, proc: Service, *, args: Sequence[str] | None = None, timeout_s: float = 180.0) -> Service:
        """Start `proc` again (same arguments unless given, same wrapper) as a new process; the old one
        must have exited."""
        assert not proc.alive(), f"{proc.name} still runs"
        return self.start(proc.name, proc.args if args is None else args, wrapper=proc.wrapper,
                          timeout_s=timeout_s)

    def live(self) -> list[Service]:
        return [proc for proc in self.procs if proc.alive()]

    def logs(self, chars: int = 6000) -> str:
        return "\n".join(f"===== {p.name} ({p.log_path.name}) =====\n{p.log()[-chars:]}" for p in self.procs)
