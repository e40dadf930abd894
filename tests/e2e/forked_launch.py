"""Workers of the e2e tests forked from one fork server per pytest process (tools/worker_forks.py)
instead of each starting a fresh interpreter.

A `pdserve launch-server` started as `python -m pdserve` spends 2-4 s of CPU importing torch,
transformers and pdserve before it does anything; the e2e tests start hundreds of workers on a
2-core machine. Forked from a process that imported all of that once, a worker is ready in a
fraction of a second, and it runs the same `pdserve.cli.main` with the same arguments, the same
environment (the whole of it is sent: the server's own is not inherited) and the same directory.

Only what a fresh interpreter would run the same way is forked: `launch-server` through the plain
launcher (no wrapper command such as `ip netns exec`, no other entry point such as
tools/hooked_worker.py), with no environment added beyond `PDSERVE_` variables (pdserve reads those
when a worker starts, pdserve/envs.py; another variable may be read by a library on import, which
the fork server has done already). Everything else, and every process of a test marked
`fresh_workers` or of a run with `--fresh-workers`, starts as before.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

import tools.launch
from tools.launch import Service
from tools.worker_forks import ForkServer

READ_AT_START = "PDSERVE_"  # the prefix of the variables pdserve reads only when a worker starts


def forkable(args: Sequence[str], env: dict[str, str] | None, wrapper: Sequence[str], module: str) -> bool:
    """Whether the launcher's child `python -m MODULE ARGS` runs the same when forked."""
    return (list(args[:1]) == ["launch-server"] and not wrapper and module == "pdserve"
            and all(name.startswith(READ_AT_START) for name in env or {}))


class ForkedLaunches:
    """A drop-in for tools.launch.spawn that forks the workers it may (see the module docstring)
    from a fork server started on first use, and starts everything else as tools.launch.spawn does.
    `enabled` is switched per test; `close` stops the server and any child still running."""

    def __init__(self, workdir: Path, plain_spawn=tools.launch.spawn) -> None:
        self.workdir = workdir
        self.plain_spawn = plain_spawn
        self.enabled = True
        self.forked = 0
        self._server: ForkServer | None = None
        self._lock = threading.Lock()  # one request at a time on the server's pipe

    def spawn(self, name: str, args: Sequence[str], log_path: Path, *, env: dict[str, str] | None = None,
              wrapper: Sequence[str] = (), module: str = "pdserve") -> Service:
        if not (self.enabled and forkable(args, env, wrapper, module)):
            return self.plain_spawn(name, args, log_path, env=env, wrapper=wrapper, module=module)
        with self._lock:
            if self._server is None or self._server.popen.poll() is not None:
                self._server = ForkServer(self.workdir)
            service = self._server.spawn(name, list(args), log_path, tools.launch.child_env(env or {}),
                                         whole_env=True, cwd=os.getcwd())
            self.forked += 1
            return service

    def close(self) -> None:
        with self._lock:
            if self._server is not None:
                self._server.close()
                self._server = None
