"""Real pdserve processes for end-to-end tests: start, read the ready line, scrape, stop.

Every process binds 127.0.0.1 with port 0 and announces its bound ports in its ready line
(`... listening on 127.0.0.1:PORT (metrics :MPORT) ...`); output goes to a log file that a failing
test prints. `Cluster` kills everything it started, whatever happens in the test.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

_READY = re.compile(r"listening on (?P<host>[\d.]+):(?P<port>\d+) \(metrics :(?P<metrics>\d+)\)")
_SAMPLE = re.compile(r"^(?P<name>[^\s{]+)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$")


@dataclass
class Proc:
    """One started service. `address` is its gRPC host:port, `metrics_port` its /metrics port."""

    name: str
    popen: subprocess.Popen
    log_path: Path
    address: str = ""
    metrics_port: int = 0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive():
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=5)

    def metrics(self) -> dict[str, float]:
        """The /metrics samples, keyed `name{labels}` as exposed (labels in exposition order)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        samples = {}
        for line in text.splitlines():
            match = _SAMPLE.match(line)
            if match and not line.startswith("#"):
                key = match["name"] + (f"{{{match['labels']}}}" if match["labels"] else "")
                samples[key] = float(match["value"])
        return samples

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        total = 0.0
        for key, value in self.metrics().items():
            base, _, rest = key.partition("{")
            if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
                total += value
        return total


@dataclass
class Cluster:
    """The processes of one test. Use as a context manager: everything is killed on exit."""

    workdir: Path
    procs: list[Proc] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop_all()

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.kill(signal.SIGTERM)

    def spawn(self, name: str, args: list[str]) -> Proc:
        """Start `pdserve ARGS` without waiting for it to be ready."""
        log_path = self.workdir / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PDSERVE_LOG_LEVEL": "INFO", **self.env}
        with open(log_path, "w") as log_file:
            popen = subprocess.Popen([sys.executable, "-m", "pdserve", *args], stdout=log_file,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)
        proc = Proc(name, popen, log_path)
        self.procs.append(proc)
        return proc

    @staticmethod
    def wait_ready(proc: Proc, timeout_s: float = 180.0) -> Proc:
        """Wait for the ready line and read the bound ports from it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = _READY.search(proc.log())
            if match:
                proc.address = f"{match['host']}:{match['port']}"
                proc.metrics_port = int(match["metrics"])
                return proc
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log()}")
            time.sleep(0.1)
        proc.kill()
        raise TimeoutError(f"{proc.name} not ready within {timeout_s:.0f}s:\n{proc.log()}")

    def start(self, name: str, args: list[str], *, timeout_s: float = 180.0) -> Proc:
        return self.wait_ready(self.spawn(name, args), timeout_s)

    def start_many(self, specs: list[tuple[str, list[str]]], timeout_s: float = 180.0) -> list[Proc]:
        """Start several services at once (their model loading overlaps), then wait for each."""
        procs = [self.spawn(name, args) for name, args in specs]
        return [self.wait_ready(proc, timeout_s) for proc in procs]

    def bootstrap(self, *extra: str) -> Proc:
        return self.start("bootstrap", ["bootstrap", "--port", "0", "--metrics-port", "0", *extra])

    def worker(self, name: str, model: str, mode: str, *, backend: str = "fake",
               bootstrap: Proc | None = None, extra: tuple[str, ...] = ()) -> Proc:
        return self.start(name, worker_args(model, mode, backend=backend, bootstrap=bootstrap, extra=extra))

    def logs(self) -> str:
        return "\n".join(f"===== {p.name} =====\n{p.log()[-6000:]}" for p in self.procs)


def worker_args(model: str, mode: str, *, backend: str = "fake", bootstrap: Proc | None = None,
                extra: tuple[str, ...] = ()) -> list[str]:
    """`pdserve launch-server` arguments for a test worker on free ports with one torch thread."""
    args = ["launch-server", "--model-path", str(model), "--disaggregation-mode", mode, "--port", "0",
            "--metrics-port", "0", "--disaggregation-transfer-backend", backend, "--num-threads", "1",
            *extra]
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
