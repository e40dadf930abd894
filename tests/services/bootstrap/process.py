"""Start `pdserve bootstrap --port 0` as a real process and read its bound ports from the ready line."""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
READY = re.compile(r"bootstrap registry listening on ([\d.]+):(\d+) \(metrics :(\d+)\)")


@dataclass
class BootstrapProcess:
    """A running registry process; its output lines are collected by a reader thread."""

    proc: subprocess.Popen
    host: str
    port: int
    metrics_port: int
    lines: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM (graceful shutdown), SIGKILL if it does not exit in time; return the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        return self.proc.returncode


def start_bootstrap(*flags: str, timeout_s: float = 60.0) -> BootstrapProcess:
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "bootstrap", "--port", "0", *flags],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready: queue.Queue[re.Match | None] = queue.Queue()

    def read_output() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            match = READY.search(line)
            if match:
                ready.put(match)
        ready.put(None)  # end of output: the process exited

    threading.Thread(target=read_output, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    try:
        match = ready.get(timeout=max(deadline - time.monotonic(), 0))
    except queue.Empty:
        match = None
    if match is None:
        proc.kill()
        proc.wait()
        raise RuntimeError("pdserve bootstrap did not become ready:\n" + "\n".join(lines))
    return BootstrapProcess(proc, match.group(1), int(match.group(2)), int(match.group(3)), lines)
