"""Mooncake Store's master (`mooncake_master`, shipped by the Mooncake wheel) as a child process of
a tool: `pdserve up --hicache mooncake` starts it before the workers and stops it after them.

It is not a pdserve service (no ready line), so it is started here and wrapped in a
tools.launch.Service: the tool then watches it, prints its log tail and stops it like its other
children. Ready means its RPC port accepts connections. Its HTTP metrics port gets a free port too
(the default, 9003, would clash with a second master on the same host).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tools.launch import NotReady, Service, _die_with_parent

NAME = "mooncake-master"


def binary() -> str | None:
    """The venv's mooncake_master (beside this Python), else the one on PATH; None if neither."""
    beside = Path(sys.executable).parent / "mooncake_master"
    return str(beside) if beside.exists() else shutil.which("mooncake_master")


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_free(host: str, port: int) -> bool:
    """Whether `port` can be bound on `host`. Checked before starting the master on a given port:
    mooncake_master binds with SO_REUSEPORT, so on a port another process listens on it starts
    "fine" and shares the connections, and workers then hang in Mooncake's setup."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a last run's TIME_WAIT does not count
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def spawn(log_dir: Path, host: str = "127.0.0.1", port: int = 0) -> Service:
    """Start mooncake_master on `host`:`port` (0: a free port), output to LOG_DIR/mooncake-master.log;
    does not wait for it (see wait_listening). The Service's address is what workers pass as
    --hicache-mooncake-master."""
    executable = binary()
    if executable is None:
        raise NotReady("mooncake_master not found (it comes with the Mooncake wheel, "
                       "mooncake-transfer-engine-non-cuda): install it or drop --hicache")
    port = port or free_port(host)
    metrics_port = free_port(host)
    args = ["-rpc_address", host, "-rpc_port", str(port),
            "-metrics_host", host, "-metrics_port", str(metrics_port)]
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{NAME}.log"
    with open(log_path, "w") as log_file:
        popen = subprocess.Popen([executable, *args], stdout=log_file, stderr=subprocess.STDOUT,
                                 start_new_session=True, preexec_fn=_die_with_parent)
    return Service(NAME, args, popen, log_path, host=host, port=port, metrics_port=metrics_port)


def wait_listening(master: Service, timeout_s: float = 30.0,
                   should_stop: Callable[[], bool] = lambda: False) -> Service:
    """Block until the master accepts connections on its RPC port. NotReady (with its log tail) if
    it exits, does not listen within `timeout_s`, or `should_stop()` says give up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not master.alive():
            raise NotReady(f"{NAME} exited with code {master.popen.returncode}:\n{master.log_tail()}")
        with socket.socket() as sock:
            sock.settimeout(1.0)
            if sock.connect_ex((master.host, master.port)) == 0:
                return master
        if should_stop():
            raise NotReady(f"{NAME}: interrupted while starting")
        time.sleep(0.1)
    master.kill(signal.SIGKILL)
    raise NotReady(f"{NAME} did not listen on {master.address} within {timeout_s:.0f}s:\n{master.log_tail()}")
