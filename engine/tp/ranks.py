"""FollowerRanks: the processes of follower ranks, started and watched by their node's process.

On node 0 that is rank 0's process (ranks 1..k-1 of the node's k); on another node, that node's
supervising process (engine.tp.node) starts all of its ranks. Each follower is `python -m
engine.tp.follower` with the engine config; it connects to the rendezvous store and rank 0's control
listener, loads its shard and follows the steps (engine.tp.runner). Lifetimes are tied both ways: a
follower exits when its parent process goes away (it watches it), and rank 0's process learns of
a follower that exits unexpectedly, or of another node that is lost, through `watch` (the worker
then exits, so its registry lease expires, instead of serving with a rank missing).
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
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.tp.control import RankControl

if TYPE_CHECKING:
    from engine.tp.rendezvous import HeartbeatWatch

log = logging.getLogger(__name__)

_REPO_ROOT = Path(__file__).resolve().parents[2]


def default_threads(tp_size: int) -> int:
    """Intra-op threads per rank when none are given: the CPUs shared out, at least one each."""
    return max(1, len(os.sched_getaffinity(0)) // tp_size)


class FollowerRanks:
    """Follower ranks as child processes of this one (rank 0's, or another node's supervising
    process). `stop` after rank 0 closed the group (or to kill them)."""

    def __init__(self, procs: list[subprocess.Popen], ranks: list[int]) -> None:
        self.procs = procs
        self.ranks = ranks
        self.controls: list[RankControl] = []  # every follower's, world ranks 1..N-1 in order; set by rank 0
        self._stopping = threading.Event()
        self._lost: list[str] = []  # why a rank on another node is gone (engine.tp.rendezvous.HeartbeatWatch)
        self.heartbeat: HeartbeatWatch | None = None  # rank 0's, set by engine.tp.setup

    @classmethod
    def start(cls, config: EngineConfig, ranks: list[int], store: tuple[str, int], control: tuple[str, int],
              authkey: bytes, transfer_host: str | None = None) -> FollowerRanks:
        """Start world ranks `ranks`, each joining the store at `store` and rank 0's control listener
        at `control`; `transfer_host` is the address their transfer engines bind (None: rank 0's)."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        procs = []
        for rank in ranks:
            spec = json.dumps({"config": asdict(config), "rank": rank, "store": list(store),
                               "parent": os.getpid(), "control": [*control, authkey.hex()],
                               "transfer_host": transfer_host})
            # The spec goes through a pipe, not argv: it carries the control socket's key, and any
            # local user can read a process's argv.
            proc = subprocess.Popen([sys.executable, "-m", "engine.tp.follower"], env=env,
                                    stdin=subprocess.PIPE)
            if proc.stdin is None:  # stdin=PIPE gives one
                raise RuntimeError("a follower rank started without its stdin pipe")
            proc.stdin.write(spec.encode())
            proc.stdin.close()
            procs.append(proc)
        return cls(procs, list(ranks))

    def exited(self) -> tuple[int, int] | None:
        """(rank, returncode) of a follower that has exited, or None while all run."""
        for rank, proc in zip(self.ranks, self.procs, strict=True):
            code = proc.poll()
            if code is not None:
                return rank, code
        return None

    def lost(self, why: str) -> None:
        """Ranks on another node are gone (`why` says which): `watch` reports it like an exit."""
        self._lost.append(why)

    def watch(self, on_exit: Callable[[str], None]) -> None:
        """Call `on_exit(why)` (from a daemon thread) if a follower exits, or another node's ranks are
        lost, before `stop`."""
        def run() -> None:
            while not self._stopping.wait(0.2):
                exited = self.exited()
                if exited:
                    why: str | None = f"tp rank {exited[0]} exited with code {exited[1]}"
                else:
                    why = self._lost[0] if self._lost else None
                if why is not None and not self._stopping.is_set():
                    on_exit(why)
                    return

        threading.Thread(target=run, name="pdserve-tp-watch", daemon=True).start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Wait for the followers to leave (rank 0 has sent them None); kill any that do not."""
        self._stopping.set()
        if self.heartbeat is not None:
            self.heartbeat.stop()
        for rank, proc in zip(self.ranks, self.procs, strict=True):
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("tp rank %d did not exit in %.0fs; killing it", rank, timeout_s)
                proc.kill()
                proc.wait()

    def kill(self) -> None:
        self._stopping.set()
        if self.heartbeat is not None:
            self.heartbeat.stop()
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
