"""asyncio helpers for cleanup that must not be cut short."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def finish_despite_cancel(work: Awaitable[T]) -> T:
    """Await `work` to the end even if the caller is cancelled meanwhile, then re-raise the
    cancellation. `asyncio.shield` alone is not enough for cleanup: it keeps the work running, but
    the caller resumes at the first cancellation and skips whatever it meant to do afterwards
    (a second cancellation, e.g. an Abort arriving while an earlier one is being handled, used to
    leave a prefill's pages held for good)."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():  # the work itself was cancelled, not just us
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result
