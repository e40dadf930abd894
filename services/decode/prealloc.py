"""The decode side's `prealloc` queue: wait, in arrival order, until pages for a prompt are free."""

from __future__ import annotations

import asyncio
import time

from engine.engine import Engine
from engine.page_manager import Reservation

_POLL_S = 0.005


class PreallocTimeout(TimeoutError):
    """No pages became free within the waiting timeout."""


class PreallocQueue:
    """First come, first served page reservation.

    Only the head of the queue polls the engine for pages, so a large prompt at the head is not
    starved by small ones behind it (they wait their turn). `asyncio.Lock` wakes waiters in FIFO
    order. Pages are freed by the engine thread; polling every few ms is cheaper than wiring a
    cross-thread notification for a queue that is empty almost always.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._turn = asyncio.Lock()

    async def reserve(self, room: str, prompt_ids: list[int], timeout_s: float) -> Reservation:
        """Pages for the prompt under `room`, its leading full pages from the prefix cache when
        there (those need no transfer: `Reservation.tail` is what prefill must write)."""
        num_tokens = len(prompt_ids)
        deadline = time.monotonic() + timeout_s
        try:
            await asyncio.wait_for(self._turn.acquire(), timeout=timeout_s)
        except TimeoutError:
            raise PreallocTimeout(f"no KV pages for {num_tokens} tokens within {timeout_s:.0f}s") from None
        try:
            hashes = self.engine.prompt_hashes(prompt_ids)  # once, not at every poll
            while True:
                reservation = self.engine.reserve_prompt(room, prompt_ids, hashes)
                if reservation is not None:
                    return reservation
                if time.monotonic() >= deadline:
                    raise PreallocTimeout(f"no KV pages for {num_tokens} tokens within {timeout_s:.0f}s")
                await asyncio.sleep(_POLL_S)
        finally:
            self._turn.release()
