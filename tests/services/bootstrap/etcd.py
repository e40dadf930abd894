"""A real single-member etcd (Debian's etcd-server) for tests: free ports on 127.0.0.1, its data in a
temp dir, killed when the test ends. Tests skip, saying why, only when no etcd binary is installed
(scripts/setup.sh installs it)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class EtcdServer:
    proc: subprocess.Popen
    client_port: int
    peer_port: int
    log_path: Path

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def etcd_binary() -> str:
    found = shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").exists() else None)
    if found is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server; scripts/setup.sh does it)")
    return found


@contextmanager
def run_etcd(tmp_path: Path, timeout_s: float = 30.0, *, client_port: int = 0, peer_port: int = 0
             ) -> Iterator[EtcdServer]:
    """etcd with its data in `tmp_path` (run it again on the same ports and dir to restart it)."""
    binary = etcd_binary()
    client_port, peer_port = client_port or _free_port(), peer_port or _free_port()
    log_path = tmp_path / "etcd.log"
    peer = f"http://127.0.0.1:{peer_port}"
    client = f"http://127.0.0.1:{client_port}"
    with open(log_path, "a") as log_file:
        proc = subprocess.Popen(
            [binary, "--name", "test", "--data-dir", str(tmp_path / "etcd-data"),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"test={peer}", "--log-level", "warn"],
            stdout=log_file, stderr=subprocess.STDOUT)
    server = EtcdServer(proc, client_port, peer_port, log_path)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {proc.returncode}:\n{server.log()}")
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=2) as reply:
                    if json.loads(reply.read()).get("health") == "true":
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd not healthy within {timeout_s:.0f}s:\n{server.log()}")
            time.sleep(0.1)
        yield server
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
