"""A mooncake_master (Mooncake Store's master) as a child process on 127.0.0.1, for the tools
that start their own store: `pdserve bench prefix-cache --case store` and the chaos scenario
`kill-store-master`. `restart` starts it again on the same port (a restarted master is empty)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path


def binary() -> str | None:
    """The mooncake_master of this interpreter's environment (the Mooncake wheel), else on PATH."""
    beside = Path(sys.executable).parent / "mooncake_master"
    return str(beside) if beside.exists() else shutil.which("mooncake_master")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MasterProcess:
    """Use as a context manager: the master is killed on exit, whatever happened."""

    def __init__(self, log_dir: Path, port: int | None = None) -> None:
        path = binary()
        if path is None:
            raise FileNotFoundError("mooncake_master not found (it comes with the Mooncake wheel, "
                                    "`mooncake-transfer-engine`)")
        self.binary, self.log_dir = path, log_dir
        self.port = port or free_port()
        self.process: subprocess.Popen | None = None
        self.starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> MasterProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.kill()

    def start(self, timeout_s: float = 30.0) -> MasterProcess:
        """Start it and wait until it accepts connections on its port."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        with open(self.log_dir / f"mooncake_master.{self.starts}.log", "w") as log:
            # Its HTTP metrics port too (default 9003): two masters on one host must not share it.
            self.process = subprocess.Popen([self.binary, "-rpc_port", str(self.port),
                                             "-metrics_port", str(free_port())],
                                            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            if self.process.poll() is not None:
                raise RuntimeError(f"mooncake_master exited at start (code {self.process.returncode}); "
                                   f"log in {self.log_dir}")
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"mooncake_master did not listen on {self.address} within {timeout_s:.0f} s")

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL and reap (a frozen master is killed all the same)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def restart(self) -> MasterProcess:
        self.kill()
        return self.start()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

