"""WorkerHooks: where a test or a tool steps into a running worker. A deployment sets none.

Tests and tools start a worker with hooks through their own entry point (tools/hooked_worker.py),
which calls services.launch_server.main with them: deployed code reads no test switch (no
environment variable, no flag), it only offers these seams.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerHooks:
    """`before_admission(room)`: decode awaits it after a room's KV has landed (prefill is done with
    it) and before the engine takes the room into its batch: the window in which an abort must
    free the reserved pages itself (tests/e2e/test_abort_window.py holds requests there)."""

    before_admission: Callable[[str], Awaitable[None]] | None = None
