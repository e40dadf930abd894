"""Pages of failed requests, held until their prefill can no longer write into them.

A one-sided transfer engine (mooncake, nixl) writes into decode's memory without decode's help,
and a write in flight cannot be recalled. So when a request fails after its pages were offered to
a prefill (the call failed, was cancelled, or the prefill's lease expired), decode answers its
caller at once but frees the pages only when it knows no write of that room can still land:

- the prefill answered Abort (its Abort returns only once it issues no more writes) and the
  writes it had issued have landed: their pages hash to the checksums the Abort reply carries
  (libkv.landing; an engine's "write done" only means sent), or
- nothing listens at the prefill's address any more (its process is gone; what its kernel had
  already sent gets `_GONE_LINGER_S` to arrive), or
- `give_up_s` passed without either (a host that vanished for good; TCP itself gives up on an
  unanswered connection after about 15 minutes, so nothing of it can arrive later). Logged.

Until then Abort is retried with backoff, so a prefill that was frozen (SIGSTOP) or cut off
answers soon after it comes back, and the pages return then. The two-sided `ucx` backend needs no
wait: once the expectation is released, late data lands in scratch memory, never in the pool.
A quarantined room stays in the room table (stage QUARANTINED, its task the one settling it) until
its pages are free, so the room cannot be used again meanwhile and the leak detector sees it live.
"""

from __future__ import annotations

import asyncio
import logging
import time

from engine.api import EngineAPI
from libkv.landing import wait_landed
from libkv.transfer import TransferBackend
from services.decode.prefill_client import AbortOutcome, PrefillClients
from services.decode.room import DecodeRoom
from services.worker.rooms import RoomTable, Stage

log = logging.getLogger("pdserve.decode")

_FIRST_RETRY_S = 0.5
_MAX_RETRY_S = 5.0
# A prefill process that is gone cannot say what it wrote; bytes its kernel had already accepted
# are delivered (on close) within milliseconds on a live link. A margin, not a proof.
_GONE_LINGER_S = 1.0


class PageQuarantine:
    """Rooms waiting for their prefill's confirmation; each settles in its own task."""

    def __init__(self, engine: EngineAPI, backend: TransferBackend, prefills: PrefillClients,
                 rooms: RoomTable[DecodeRoom],
                 give_up_s: float) -> None:
        self.engine = engine
        self.backend = backend
        self.prefills = prefills
        self.rooms = rooms
        self.give_up_s = give_up_s

    def hold(self, room: DecodeRoom, pages: list[int]) -> None:
        """Stop the room's prefill (`room.prefill_address`) and free its pages (`pages`, in the order
        offered to the prefill) once that is confirmed (see the module doc); the room leaves the
        table then. Returns at once; callable from a cancelled task."""
        if room.stage is Stage.QUARANTINED:
            return
        room.stage = Stage.QUARANTINED
        room.task = asyncio.get_running_loop().create_task(self._settle(room.id, room.prefill_address, pages),
                                                           name=f"quarantine-{room.id}")
        room.task.add_done_callback(lambda _: self.rooms.close(room))

    async def _settle(self, room: str, prefill_address: str, pages: list[int]) -> None:
        self.backend.release_expectation(room)
        if not self.backend.one_sided:
            self.engine.release(room)  # late data for the room now lands in scratch memory
            await self.prefills.abort(prefill_address, room)  # still stop the prefill's work
            return
        try:
            await self._wait_until_safe(room, prefill_address, pages)
        finally:
            self.engine.release(room)

    async def _wait_until_safe(self, room: str, prefill_address: str, pages: list[int]) -> None:
        started = time.monotonic()
        delay = _FIRST_RETRY_S
        while True:
            reply = await self.prefills.abort(prefill_address, room)
            if reply.outcome is AbortOutcome.CONFIRMED:
                await self._wait_issued_writes(room, pages, reply.page_checksums, reply.tp_size)
            elif reply.outcome is AbortOutcome.GONE:
                await asyncio.sleep(_GONE_LINGER_S)
            if reply.outcome is not AbortOutcome.UNKNOWN:
                if delay > _FIRST_RETRY_S:
                    log.info("room %s: prefill %s %s after %.1fs; the room's pages are free again", room,
                             prefill_address, "confirmed the abort" if reply.outcome is AbortOutcome.CONFIRMED
                             else "is gone", time.monotonic() - started)
                return
            if delay == _FIRST_RETRY_S:
                log.warning("room %s: prefill %s does not confirm the abort; the room's pages stay "
                            "quarantined until it does or is gone (at most %.0fs)", room, prefill_address,
                            self.give_up_s)
            if time.monotonic() - started >= self.give_up_s:
                log.error("room %s: prefill %s neither confirmed the abort nor went away in %.0fs; "
                          "freeing its pages", room, prefill_address, self.give_up_s)
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, _MAX_RETRY_S)

    async def _wait_issued_writes(self, room: str, pages: list[int], sent: list[int],
                                  sender_tp_size: int) -> None:
        if len(sent) > len(pages):
            log.error("room %s: the prefill reports %d writes for %d pages; not waiting for them", room,
                      len(sent), len(pages))
            return
        never = await wait_landed(self.engine.pool_for(room), pages[:len(sent)], sent,
                                  sender_tp_size=sender_tp_size)
        if never:  # a write that failed midway never completes; it cannot land later either
            log.warning("room %s: %d of the %d pages the prefill wrote before the abort never matched "
                        "what it sent (a write cut short); freeing them", room, len(never), len(sent))

    async def close(self) -> None:
        tasks = [room.task for room in self.rooms.rooms(Stage.QUARANTINED) if room.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
