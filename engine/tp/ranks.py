"""FollowerRanks: the processes of TP ranks 1..N-1, started and watched by rank 0's process.

Each follower is `python -m engine.tp.follower` with the engine config; it connects to rank 0's
rendezvous port and control listener, loads its shard and follows the steps (engine.tp.runner). Lifetimes are tied both
ways: a follower exits when rank 0's process goes away (it watches its parent), and rank 0's
process learns of a follower that exits unexpectedly through `watch` (the worker then exits, so
its registry lease expires, instead of serving with a rank missing).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from engine.config import EngineConfig
from engine.tp.control import ControlListener, RankControl

log = logging.getLogger(__name__)

_REPO_ROOT = Path(__file__).resolve().parents[2]


def default_threads(tp_size: int) -> int:
    """Intra-op threads per rank when none are given: the CPUs shared out, at least one each."""
    return max(1, len(os.sched_getaffinity(0)) // tp_size)


class FollowerRanks:
    """Ranks 1..size-1 as child processes. `stop` after rank 0 closed the group (or to kill them)."""

    def __init__(self, procs: list[subprocess.Popen]) -> None:
        self.procs = procs
        self.controls: list[RankControl] = []  # rank order; set once every follower has connected
        self._stopping = threading.Event()

    @classmethod
    def start(cls, config: EngineConfig, port: int, control: ControlListener) -> FollowerRanks:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        procs = []
        for rank in range(1, config.world_size):
            spec = json.dumps({"config": asdict(config), "rank": rank, "port": port, "parent": os.getpid(),
                               "control": [*control.address, control.authkey.hex()]})
            # The spec goes through a pipe, not argv: it carries the control socket's key, and any
            # local user can read a process's argv.
            proc = subprocess.Popen([sys.executable, "-m", "engine.tp.follower"], env=env, stdin=subprocess.PIPE)
            proc.stdin.write(spec.encode())
            proc.stdin.close()
            procs.append(proc)
        return cls(procs)

    def exited(self) -> tuple[int, int] | None:
        """(rank, returncode) of a follower that has exited, or None while all run."""
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                return rank, code
        return None

    def watch(self, on_exit: Callable[[int, int], None]) -> None:
        """Call `on_exit(rank, returncode)` (from a daemon thread) if a follower exits before `stop`."""
        def run() -> None:
            while not self._stopping.wait(0.2):
                exited = self.exited()
                if exited is not None and not self._stopping.is_set():
                    on_exit(*exited)
                    return

        threading.Thread(target=run, name="pdserve-tp-watch", daemon=True).start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Wait for the followers to leave (rank 0 has sent them None); kill any that do not."""
        self._stopping.set()
        for rank, proc in enumerate(self.procs, start=1):
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("tp rank %d did not exit in %.0fs; killing it", rank, timeout_s)
                proc.kill()
                proc.wait()

    def kill(self) -> None:
        self._stopping.set()
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
