"""pdserve services as real child processes: start, read the ready line, signal, scrape, stop.

The one launcher of every tool that starts pdserve processes: `pdserve up`, the chaos suite, the
benchmarks and the e2e tests.

Ready protocol: every pdserve service logs a ready line `... listening on HOST:PORT (metrics :MPORT) ...`
once it serves; `Service.wait_ready` reads the bound ports from it, so services can be started on
port 0. The line is logged at INFO, so a child never runs at a quieter log level.

Each child runs `python -m pdserve ARGS` (or another entry point with pdserve's arguments, such as
tools/hooked_worker.py; under an optional wrapper command such as `ip netns exec NS`), writes its
output to one log file, runs in its own session (a Ctrl-C in the terminal reaches only the parent,
which then stops its children in order) and gets SIGKILL if the parent dies without cleaning up
(PR_SET_PDEATHSIG). Stopping is SIGTERM, then SIGKILL after a grace
period. `ProcessGroup` stops everything it started when its `with` block ends, whatever happened.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from pdserve import envs
from tools.metrics import scrape, sum_samples

READY = re.compile(r"listening on (?P<host>[\w.\-\[\]:]+?):(?P<port>\d+) \(metrics :(?P<metrics>\d+)\)")

_PR_SET_PDEATHSIG = 1
_LOUD_ENOUGH = ("DEBUG", "INFO")  # log levels at which the ready line is written


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: SIGKILL it when the parent goes away, so a harness
    killed with -9 leaves no orphans behind. Linux only; elsewhere it is skipped."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment of a child: ours, unbuffered output, `extra`, and a log level that shows the
    ready line (a quieter one would leave the launcher waiting for it forever)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra}
    if env.get(envs.LOG_LEVEL.name, "INFO").upper() not in _LOUD_ENOUGH:
        env[envs.LOG_LEVEL.name] = "INFO"
    return env


class ChildProcess(Protocol):
    """What a Service needs of its process: subprocess.Popen, or a worker forked by another process
    (tools.worker_forks.ForkedChild)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


class NotReady(RuntimeError):
    """A service exited or did not log its ready line in time; the message carries its log tail."""


@dataclass
class Service:
    """One started pdserve process. `address` is its gRPC (or HTTP, for the gateway) host:port once
    ready; `metrics_port` serves /metrics on the same host. `args`, `wrapper` (a command the
    process runs under, e.g. `ip netns exec NS`) and `module` (what `python -m` runs) are kept so
    the service can be started again."""

    name: str
    args: list[str]
    popen: ChildProcess
    log_path: Path
    wrapper: tuple[str, ...] = ()
    module: str = "pdserve"
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

    def log_tail(self, chars: int = 6000) -> str:
        return self.log()[-chars:]

    def alive(self) -> bool:
        return self.popen.poll() is None

    def send(self, sig: int) -> None:
        """Deliver `sig` if the process still runs (SIGSTOP/SIGCONT freeze and thaw it)."""
        if self.alive():
            self.popen.send_signal(sig)

    def kill(self, sig: int = signal.SIGKILL, wait_s: float = 15.0) -> bool:
        """Send `sig` and wait for the exit; SIGKILL if it outlives `wait_s`. A stopped process is
        continued first, or it could not act on a SIGTERM. False if it had to be killed."""
        if not self.alive():
            return True
        self.popen.send_signal(sig)
        if sig not in (signal.SIGKILL, signal.SIGCONT):
            self.popen.send_signal(signal.SIGCONT)
        try:
            self.popen.wait(timeout=wait_s)
            return True
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=5)
            return False

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
            raise NotReady(f"{self.name} exited with code {self.popen.returncode}:\n{self.log_tail()}")
        return False

    def not_ready(self, why: str) -> NotReady:
        """Kill the process (it failed to come up) and describe why, with its log tail."""
        self.kill()
        return NotReady(f"{self.name} {why}:\n{self.log_tail()}")

    def wait_ready(self, timeout_s: float = 180.0,
                   should_stop: Callable[[], bool] = lambda: False) -> Service:
        """Block until the ready line appears and read the bound ports from it. `should_stop` (polled
        every 0.1 s) gives up early, leaving the process to the caller's stop."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.poll_ready():
                return self
            if should_stop():
                raise NotReady(f"{self.name}: interrupted while starting")
            time.sleep(0.1)
        raise self.not_ready(f"not ready within {timeout_s:.0f}s")

    def metrics(self, timeout_s: float = 5.0) -> dict[str, float]:
        """The /metrics samples, keyed `name{labels}` as exposed."""
        return scrape(f"http://{self.host}:{self.metrics_port}/metrics", timeout_s)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (0 if none)."""
        return sum_samples(self.metrics(), name, **labels) or 0.0


def spawn(name: str, args: Sequence[str], log_path: Path, *, env: dict[str, str] | None = None,
          wrapper: Sequence[str] = (), module: str = "pdserve") -> Service:
    """Start `python -m MODULE ARGS` (`pdserve ARGS`; under `wrapper`, if any) without waiting for it
    to be ready: its own session, output to `log_path`, SIGKILL when this process dies."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log_file:
        popen = subprocess.Popen([*wrapper, sys.executable, "-m", module, *args], stdout=log_file,
                                 stderr=subprocess.STDOUT, env=child_env(env or {}), start_new_session=True,
                                 preexec_fn=_die_with_parent)
    return Service(name, list(args), popen, log_path, tuple(wrapper), module)


def stop_in_order(services: Iterable[Service], grace_s: float = 10.0,
                  report: Callable[[str], None] = lambda line: None) -> None:
    """SIGTERM each live service in the given order (each gets up to `grace_s` to exit, then SIGKILL)
    and report one line per service stopped."""
    for service in services:
        if not service.alive():
            continue
        if service.kill(signal.SIGTERM, wait_s=grace_s):
            report(f"stopped {service.name} (exit code {service.popen.returncode})")
        else:
            report(f"killed {service.name}: it did not stop within {grace_s:.0f}s")


@dataclass
class ProcessGroup:
    """The processes of one run, logs in `workdir`. Use as a context manager: everything is stopped
    on exit. `env` is added to every child's environment (after os.environ)."""

    workdir: Path
    env: dict[str, str] = field(default_factory=dict)
    procs: list[Service] = field(default_factory=list)

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop_all()

    def stop_all(self, grace_s: float = 10.0, report: Callable[[str], None] = lambda line: None) -> None:
        """Stop the live processes newest first (the gateway before workers before the registry)."""
        stop_in_order(reversed(self.procs), grace_s, report)

    def spawn(self, name: str, args: Sequence[str], *, wrapper: Sequence[str] = (),
              module: str = "pdserve") -> Service:
        """Start `pdserve ARGS` (`python -m MODULE ARGS`) without waiting for it to be ready. A name
        used before gets a numbered log file, so the log of a killed process is kept."""
        earlier = sum(1 for proc in self.procs if proc.name == name)
        log_path = self.workdir / (f"{name}.log" if not earlier else f"{name}.{earlier}.log")
        proc = spawn(name, args, log_path, env=self.env, wrapper=wrapper, module=module)
        self.procs.append(proc)
        return proc

    def start(self, name: str, args: Sequence[str], *, wrapper: Sequence[str] = (),
              module: str = "pdserve", timeout_s: float = 180.0) -> Service:
        return self.spawn(name, args, wrapper=wrapper, module=module).wait_ready(timeout_s)

    def start_many(self, specs: Sequence[tuple[str, Sequence[str]]],
                   timeout_s: float = 180.0) -> list[Service]:
        """Start several services at once (their model loading overlaps), then wait for each."""
        procs = [self.spawn(name, args) for name, args in specs]
        return [proc.wait_ready(timeout_s) for proc in procs]

    def restart(self, proc: Service, *, args: Sequence[str] | None = None,
                timeout_s: float = 180.0) -> Service:
        """Start `proc` again (same arguments unless given, same wrapper) as a new process; the old one
        must have exited."""
        assert not proc.alive(), f"{proc.name} still runs"
        return self.start(proc.name, proc.args if args is None else args, wrapper=proc.wrapper,
                          module=proc.module, timeout_s=timeout_s)

    def live(self) -> list[Service]:
        return [proc for proc in self.procs if proc.alive()]

    def logs(self, chars: int = 6000) -> str:
        return "\n".join(f"===== {p.name} ({p.log_path.name}) =====\n{p.log_tail(chars)}" for p in self.procs)
