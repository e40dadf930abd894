"""The room table: every room (request) one worker is working on, in one place.

A room names one request on both sides of PD and in every log line. The table holds each room's
stage, the task working on it, and what its role keeps for it: a role's room is a subclass of
`Room` with its own fields (decode: services/decode/room.py, the pages reserved for the prompt and
the Prefill call; prefill: services/prefill/room.py, its KV writes), and the role's servicer keeps
a `RoomTable` of that type. Everything that asks about rooms reads it:
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
are remembered, a bounded number, as DONE: what `Room.remembered` keeps of them (whether an Abort
named the room, so that a new request for it is refused: its pages on decode may be in other hands
by now; a prefill room also the checksums of the writes it issued, so that an Abort that comes
after the end learns what may still be landing).

Threads: the event loop changes the table; metric scrapes read its counts from their own thread.
"""

from __future__ import annotations

import asyncio
import enum
import threading
from collections import OrderedDict
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from services.worker.metrics import HANDSHAKE

T = TypeVar("T")
R = TypeVar("R", bound="Room")


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
    """One room in the table: what every role keeps. `task`: what works on it now (its RPC
    handler; a quarantined room's settling task). `closing`: its cleanup has begun, so an Abort
    waits for it (`ended`) instead of cancelling the task. `aborted`: an Abort named the room."""

    id: str
    stage: Stage
    task: asyncio.Task | None = None
    closing: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    aborted: bool = False

    def remembered(self: R) -> R | None:
        """What the table keeps of this room once it is done, where the role keeps done rooms: a
        DONE record when an Abort named it, else nothing (a role's room may keep more)."""
        return type(self)(self.id, Stage.DONE, aborted=True) if self.aborted else None


class RoomView(Protocol):
    """What the worker's runtime reads of its role's room table: the queue gauges, WorkerLoad, the
    "Decode batch" log line and the leak detector."""

    @property
    def stages(self) -> tuple[Stage, ...]: ...

    def counts(self) -> dict[str, int]: ...

    def live(self) -> set[str]: ...


class RoomTable(Generic[R]):
    """The rooms of one worker (see the module docstring). `role`: prefill, decode or colocated;
    `room_type`: the role's Room, which `open` creates."""

    def __init__(self, role: str, room_type: type[R]) -> None:
        self.stages = QUEUES.get(role, QUEUES["decode"])  # colocated: decode's queues, all but running empty
        self.room_type = room_type
        self._remember = _REMEMBERED.get(role, 0)
        self._rooms: OrderedDict[str, R] = OrderedDict()  # live rooms, and remembered DONE ones
        self._done = 0
        self._lock = threading.Lock()

    def open(self, room_id: str, stage: Stage, task: asyncio.Task | None = None) -> R:
        """A new live room; RoomInUse if `room_id` is live here or an Abort named it."""
        with self._lock:
            known = self._rooms.get(room_id)
            if known is not None:
                if known.stage is not Stage.DONE or known.aborted:
                    raise RoomInUse(known)
                del self._rooms[room_id]  # a new request of a room that ended normally
                self._done -= 1
            room = self.room_type(room_id, stage, task)
            self._rooms[room_id] = room
            return room

    def get(self, room_id: str) -> R | None:
        """The live room; None if `room_id` is not live here (`done` tells what is remembered)."""
        with self._lock:
            room = self._rooms.get(room_id)
        return room if room is not None and room.stage is not Stage.DONE else None

    def done(self, room_id: str) -> R | None:
        """What is remembered of a done room (Room.remembered), None if nothing."""
        with self._lock:
            room = self._rooms.get(room_id)
        return room if room is not None and room.stage is Stage.DONE else None

    def close(self, room: R) -> None:
        """`room` is done: it leaves the table and `room.ended` is set. Where the role keeps done
        rooms, what `room.remembered()` gives stays as DONE."""
        with self._lock:
            if self._rooms.get(room.id) is room:
                del self._rooms[room.id]
                record = room.remembered() if self._remember else None
                if record is not None:
                    self._remember_done(record)
        room.ended.set()

    def name_in_abort(self, room_id: str) -> R:
        """An Abort named `room_id`: mark the room so that a new request of it is refused (a room not
        here is remembered as DONE, where the role keeps done rooms). Returns the room: live, or
        its DONE record."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None:
                room = self.room_type(room_id, Stage.DONE)
                if self._remember:
                    self._remember_done(room)
            room.aborted = True
            return room

    def _remember_done(self, room: R) -> None:
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

    def rooms(self, stage: Stage | None = None) -> list[R]:
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
