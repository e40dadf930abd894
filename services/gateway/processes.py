"""`launch-router --workers N`: N gateway processes serving one port.

The parent binds the port with SO_REUSEPORT without listening (it holds the port, port 0 included),
then starts N ordinary gateway processes (`launch-router` with the same flags, that port and
`--workers 1`) that bind it beside it with SO_REUSEPORT (PDSERVE_GATEWAY_REUSE_PORT) and listen: the
kernel spreads new connections over their listening sockets by a hash of the connection's addresses.
Each process is a whole gateway: it watches the registry, subscribes to KV events and routes with the
full policy on its own, so no state is shared and a stream never crosses processes. /metrics answers
for the process that accepted the scrape (Prometheus sums over pods, not over processes inside one:
scrape with one process per pod, or read the figures as per-process samples).

The parent forwards SIGINT/SIGTERM to every process and waits for them; if one exits on its own, the
others are stopped and the parent exits 1, so a supervisor (Kubernetes) restarts the whole set.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from pdserve import envs

log = logging.getLogger("pdserve.gateway")


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the parent dies (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass  # not Linux: the parent's signal handlers are all there is


def child_args(argv: Sequence[str], port: int) -> list[str]:
    """`argv` (this command's arguments after the program) for one of the N processes: the same
    flags on the bound `port` with --workers 1 (the last occurrence of a flag wins in argparse)."""
    return [*argv, "--port", str(port), "--workers", "1"]


def run_processes(count: int, port: int, argv: Sequence[str], grace_s: float) -> int:
    """Start `count` gateway processes on `port` (held by the caller); return the exit code once they
    have all stopped (see the module docstring)."""
    env = dict(os.environ, **{envs.GATEWAY_REUSE_PORT.name: "1"})
    command = [sys.executable, "-m", "pdserve", *child_args(argv, port)]
    # Their own session: a terminal's Ctrl-C reaches the parent only, which forwards it once (a second
    # SIGINT would end a gateway's graceful stop). They die with the parent if it is killed.
    children = [subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=_die_with_parent)
                for _ in range(count)]
    log.info("gateway: %d processes (pids %s) share port %d", count, " ".join(str(c.pid) for c in children),
             port)
    received: list[int] = []

    def forward(signum: int, frame: object) -> None:
        received.append(signum)
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not received and all(c.poll() is None for c in children):
            time.sleep(0.2)
        if not received:
            died = next(c for c in children if c.poll() is not None)
            log.error("gateway process %d exited with %s: stopping the others", died.pid, died.returncode)
            forward(signal.SIGTERM, None)
        deadline = time.monotonic() + grace_s + 5.0
        for child in children:
            try:
                child.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received and all(c.returncode == 0 for c in children):
        return 0
    return 1
