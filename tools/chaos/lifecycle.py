"""Waiting on processes from asyncio code without stalling the event loop.

The chaos suite keeps its load clients running while services start and stop, so it never blocks on
a process: it polls (`Service.poll_ready`, `Popen.poll`) between short sleeps. Processes are spawned
from the event loop's thread (the main thread) on purpose: their PR_SET_PDEATHSIG is tied to the
thread that forked them, and a pool thread may exit early.
"""

from __future__ import annotations

import asyncio
import signal
import time

from tools.launch import Service


async def until_ready(service: Service, timeout_s: float) -> Service:
    """Wait for the ready line; raises NotReady (and kills the process) if it does not come."""
    deadline = time.monotonic() + timeout_s
    while not service.poll_ready():
        if time.monotonic() > deadline:
            raise service.not_ready(f"not ready within {timeout_s:.0f}s")
        await asyncio.sleep(0.1)
    return service


async def stop(service: Service, sig: int = signal.SIGTERM, grace_s: float = 10.0) -> None:
    """Send `sig` (continuing a frozen process so it can act on it), wait up to `grace_s` for the
    exit, then SIGKILL."""
    if not service.alive():
        return
    service.send(sig)
    if sig != signal.SIGKILL:
        service.send(signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    while service.alive() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if service.alive():
        service.send(signal.SIGKILL)
        while service.alive():
            await asyncio.sleep(0.05)
