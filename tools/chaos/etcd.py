"""A single-member etcd for a chaos deployment whose registry keeps its workers in etcd
(`--registry-store etcd`): Debian's etcd binary on free ports, its data under the deployment's log
folder, killed with the deployment. The etcd-restart scenario kills it and starts it again on the
same ports, on its data or on a wiped data dir.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tools.launch import _die_with_parent


class EtcdUnavailable(RuntimeError):
    """No etcd binary, or it did not become healthy; the message says which."""


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class EtcdProcess:
    """etcd listening on `host`:`client_port` (peers on `peer_port`), data in `data_dir`."""

    host: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    popen: subprocess.Popen | None = None

    @classmethod
    def on_free_ports(cls, host: str, workdir: Path) -> EtcdProcess:
        return cls(host, _free_port(host), _free_port(host), workdir / "etcd-data", workdir / "etcd.log")

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    async def start(self, timeout_s: float = 30.0, *, wipe: bool = False) -> None:
        """Start etcd (on its data, or on an empty data dir with `wipe`) and wait until it is healthy."""
        binary = shutil.which("etcd")
        if binary is None:
            raise EtcdUnavailable("etcd is not installed (scripts/setup.sh installs etcd-server)")
        if wipe:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        peer, client = f"http://{self.host}:{self.peer_port}", self.endpoint
        with open(self.log_path, "a") as log_file:
            self.popen = subprocess.Popen(
                [binary, "--name", "chaos", "--data-dir", str(self.data_dir), "--listen-client-urls", client,
                 "--advertise-client-urls", client, "--listen-peer-urls", peer,
                 "--initial-advertise-peer-urls", peer, "--initial-cluster", f"chaos={peer}",
                 "--log-level", "warn"],
                stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2) as http:
            while time.monotonic() < deadline:
                if not self.alive():
                    raise EtcdUnavailable(f"etcd exited with {self.popen.returncode}; see {self.log_path}")
                try:
                    if (await http.get(f"{client}/health")).json().get("health") == "true":
                        return
                except (httpx.HTTPError, ValueError):
                    pass
                await asyncio.sleep(0.1)
        await self.kill()
        raise EtcdUnavailable(f"etcd not healthy within {timeout_s:.0f}s; see {self.log_path}")

    async def kill(self) -> None:
        """SIGKILL (as a crash would) and wait for the exit."""
        if self.alive():
            assert self.popen is not None
            self.popen.send_signal(signal.SIGKILL)
            while self.popen.poll() is None:
                await asyncio.sleep(0.05)
