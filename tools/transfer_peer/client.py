"""Drives transfer peer processes (tools.transfer_peer.worker) over pipes, for tests and benchmarks."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

from tools.transfer_peer.worker import REPLY_PREFIX

REPO_ROOT = Path(__file__).resolve().parents[2]


class PeerError(RuntimeError):
    def __init__(self, reply: dict) -> None:
        super().__init__(f"{reply['error_type']}: {reply['error']}")
        self.error_type = reply["error_type"]
        self.message = reply["error"]


class PeerProcess:
    """One peer process. call() sends a command and returns its reply (raising PeerError if the
    command failed); send()/reply() split that for commands that run while the test acts."""

    def __init__(self, name: str = "peer") -> None:
        python_path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, PYTHONPATH=python_path, UCX_WARN_UNUSED_ENV_VARS="n", OMP_NUM_THREADS="1")
        self.name = name
        self.proc = subprocess.Popen([sys.executable, "-m", "tools.transfer_peer.worker"], cwd=REPO_ROOT,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1)
        self.stdin, self.stdout = _pipe(self.proc.stdin), _pipe(self.proc.stdout)
        self.stderr = _pipe(self.proc.stderr)
        self.replies: queue.Queue[dict] = queue.Queue()
        self.stderr_tail: list[str] = []
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stdout(self) -> None:
        for line in self.stdout:
            if line.startswith(REPLY_PREFIX):
                self.replies.put(json.loads(line[len(REPLY_PREFIX):]))

    def _read_stderr(self) -> None:
        for line in self.stderr:
            self.stderr_tail = (self.stderr_tail + [line.rstrip()])[-40:]

    def send(self, op: str, **args) -> None:
        self.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.stdin.flush()

    def reply(self, timeout: float = 60.0, *, check: bool = True) -> dict:
        try:
            reply = self.replies.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"{self.name}: no reply within {timeout} s (rc={self.proc.poll()}); "
                               f"stderr: {self.stderr_tail[-10:]}") from None
        if check and "error" in reply:
            raise PeerError(reply)
        return reply

    def call(self, op: str, timeout: float = 60.0, **args) -> dict:
        self.send(op, **args)
        return self.reply(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self) -> None:
        """Ask for a clean close + exit; kill if that does not finish promptly."""
        if self.proc.poll() is None:
            try:
                self.call("close", timeout=15)
                self.proc.wait(timeout=10)
            except (TimeoutError, PeerError, OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            self.kill()
        for stream in (self.stdin, self.stdout, self.stderr):
            try:
                stream.close()
            except OSError:
                pass


def _pipe(stream: IO[str] | None) -> IO[str]:
    """One of the child's pipes (Popen makes each one asked for with PIPE)."""
    if stream is None:
        raise RuntimeError("the peer process was started without one of its pipes")
    return stream
