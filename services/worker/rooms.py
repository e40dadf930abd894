"""The room table: every room (request) one worker is working on, in one place.

A room names one request on both sides of PD and in every log line. The table holds each room's
stage, the task working on it, and what its role keeps for it (decode: the pages reserved for the
prompt and the Prefill call; prefill: its KV writes). Everything that asks about rooms reads it:
the refusal of a room already in use (one lookup, in `open`), Abort, the queue gauges
(`pdserve:queue_requests{queue}`), WorkerLoad in heartbeats and GetLoad, the "Decode batch" log
line and the leak detector (`live`). What the engine runs (its scheduler), the pages reserved or
held under a room (its page manager) and the grants a transfer backend expects are those parts'
own records, not copies of this one.

Stages (`Stage`; a stage's value is its label in `queue_requests{queue}`):
  decode     PREALLOC -> TRANSFER -> RUNNING; QUARANTINED when it failed after its pages were
             offered to a prefill, until no write for them can land (services/decode/quarantine.py).
             A prompt run on the decode worker itself (conditional disaggregation) is RUNNING at once.
  prefill    HANDSHAKE -> WAITING -> INFLIGHT
  colocated  RUNNING
A decode or colocated worker's `waiting` and `running` queues are its engine's (requests waiting
for admission, the running batch): WorkerRuntime.queue_counts.
A room leaves the table when it is done (`close`). Where the role asks for it (prefill), done rooms
are remembered, a bounded number, as DONE: whether an Abort named the room (then a new request for
it is refused: its pages on decode may be in other hands by now) and the checksums of the writes it
issued (an Abort that comes after the end learns what may still be landing).

Threads: the event loop changes the table; metric scrapes read its counts from their own thread.
"""

from __future__ import annotations

import asyncio
import enum
import threading
from collections import OrderedDict
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine.page_manager import Reservation
from services.worker.metrics import HANDSHAKE

T = TypeVar("T")


class Stage(enum.Enum):
    """Where a room is (see the module docstring); the value is the queue label."""

    PREALLOC = "prealloc"  # decode: waiting for pages to reserve for the prompt
    TRANSFER = "transfer"  # decode: a prefill runs the prompt and writes its KV into the pages
    HANDSHAKE = HANDSHAKE  # prefill: meeting decode's transfer endpoint, checking its reservation
    WAITING = "waiting"  # prefill: the prompt runs, its pages sent as chunks finish
    INFLIGHT = "inflight"  # prefill: the prompt ran; its last writes are landing
    RUNNING = "running"  # decode, colocated: in the engine, tokens streaming back
    QUARANTINED = "quarantined"  # decode: failed; its pages wait until no write of the room can land
    DONE = "done"  # ended, and remembered (prefill)


# The queues each role exports in `queue_requests{queue}`, in this order.
QUEUES = {"prefill": (Stage.HANDSHAKE, Stage.WAITING, Stage.INFLIGHT),
          "decode": (Stage.PREALLOC, Stage.TRANSFER, Stage.WAITING, Stage.RUNNING)}
_REMEMBERED = {"prefill": 4096}  # done rooms kept per role


class RoomInUse(Exception):
    """`RoomTable.open` of a room that is live here, or that an Abort named (`room`)."""

    def __init__(self, room: Room) -> None:
        super().__init__(room.id)
        self.room = room


@dataclass(eq=False)
class Room:
    """One room in the table. `task`: what works on it now (its RPC handler; a quarantined room's
    settling task). `closing`: its cleanup has begun, so an Abort waits for it (`ended`) instead of
    cancelling the task."""

    id: str
    stage: Stage
    task: asyncio.Task | None = None
    closing: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    # decode
    local: bool = False  # the prompt runs on this worker (conditional disaggregation)
    reservation: Reservation | None = None  # pages for the prompt; `tail` is offered to the prefill
    prefill_address: str = ""
    call: asyncio.Future | None = None  # the Prefill call, while it is open
    lost: str = ""  # why the prefill was given up on while the call was open
    # prefill
    writes: Any = None  # services.prefill.writes.RoomWrites
    # remembered after the end (DONE)
    aborted: bool = False  # an Abort named the room
    checksums: list[int] = field(default_factory=list)  # of the writes it issued, in order


class RoomTable:
    """The rooms of one worker (see the module docstring). `role`: prefill, decode or colocated."""

    def __init__(self, role: str) -> None:
        self.stages = QUEUES.get(role, QUEUES["decode"])  # colocated: decode's queues, all but running empty
        self._remember = _REMEMBERED.get(role, 0)
        self._rooms: OrderedDict[str, Room] = OrderedDict()
        self._done = 0
        self._lock = threading.Lock()

    def open(self, room_id: str, stage: Stage, task: asyncio.Task | None = None) -> Room:
        """A new live room; RoomInUse if `room_id` is live here or an Abort named it."""
        with self._lock:
            known = self._rooms.get(room_id)
            if known is not None:
                if known.stage is not Stage.DONE or known.aborted:
                    raise RoomInUse(known)
                del self._rooms[room_id]  # a new request of a room that ended normally
                self._done -= 1
            room = self._rooms[room_id] = Room(room_id, stage, task)
            return room

    def get(self, room_id: str) -> Room | None:
        """The room, live or remembered (DONE); None if the table has no such room."""
        with self._lock:
            return self._rooms.get(room_id)

    def close(self, room: Room, checksums: list[int] | None = None) -> None:
        """`room` is done: it leaves the table and `room.ended` is set. Where the role keeps done
        rooms, one an Abort named or that issued writes (their `checksums`) is remembered as DONE."""
        with self._lock:
            if self._rooms.get(room.id) is room:
                del self._rooms[room.id]
                if self._remember and (room.aborted or checksums):
                    self._remember_done(Room(room.id, Stage.DONE, aborted=room.aborted, checksums=checksums or []))
        room.ended.set()

    def name_in_abort(self, room_id: str) -> Room:
        """An Abort named `room_id`: mark the room so that a new request of it is refused (a room not
        here is remembered as DONE, where the role keeps done rooms). Returns the room."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None:
                room = Room(room_id, Stage.DONE)
                if self._remember:
                    self._remember_done(room)
            room.aborted = True
            return room

    def _remember_done(self, room: Room) -> None:
        self._rooms[room.id] = room
        self._done += 1
        while self._done > self._remember:  # forget the oldest done room (live ones stay)
            oldest = next(r for r in self._rooms.values() if r.stage is Stage.DONE)
            del self._rooms[oldest.id]
            self._done -= 1

    def live(self) -> set[str]:
        """Rooms not done yet, quarantined ones included (a snapshot)."""
        with self._lock:
            return {r.id for r in self._rooms.values() if r.stage is not Stage.DONE}

    def rooms(self, stage: Stage | None = None) -> list[Room]:
        """The live rooms, or those in `stage` (a snapshot)."""
        with self._lock:
            return [r for r in self._rooms.values() if r.stage is not Stage.DONE and stage in (None, r.stage)]

    def counts(self) -> dict[str, int]:
        """Rooms in each of the role's queues, by queue label."""
        with self._lock:
            stages = [r.stage for r in self._rooms.values()]
        return {stage.value: stages.count(stage) for stage in self.stages}


async def finish_despite_cancel(work: Awaitable[T]) -> T:
    """Await `work` to the end even if the caller is cancelled meanwhile, then re-raise the
    cancellation: a room's cleanup must not be cut short. `asyncio.shield` alone is not enough: it
    keeps the work running, but the caller resumes at the first cancellation and skips whatever it
    meant to do afterwards (a second cancellation, e.g. an Abort arriving while an earlier one is
    being handled, used to leave a prefill's pages held for good)."""
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
