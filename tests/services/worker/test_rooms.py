"""The room table, exact: stages and their queue counts, the refusal of a room in use, the record of
done rooms a prefill keeps, and cleanup that a second cancellation cannot cut short."""

from __future__ import annotations

import asyncio

import pytest

from services.prefill.room import PrefillRoom
from services.prefill.writes import RoomWrites
from services.worker.rooms import QUEUES, Room, RoomInUse, RoomTable, Stage, finish_despite_cancel


def issued(room: PrefillRoom, checksums: list[int]) -> PrefillRoom:
    """`room` as if its writes had issued pages with these checksums."""
    room.writes = RoomWrites(room.id, backend=None, queues=None, peer=None, dst_page_ids=[],
                             checksums=list(checksums))
    return room


def test_a_room_in_use_is_refused_until_it_is_closed():
    rooms = RoomTable("decode", Room)
    room = rooms.open("a", Stage.PREALLOC)
    with pytest.raises(RoomInUse):
        rooms.open("a", Stage.PREALLOC)
    assert rooms.live() == {"a"} and rooms.get("a") is room
    rooms.close(room)
    assert room.ended.is_set() and rooms.get("a") is None and rooms.live() == set()
    rooms.open("a", Stage.RUNNING)  # a room that ended may name a new request


def test_counts_by_queue_label():
    prefill, decode = RoomTable("prefill", PrefillRoom), RoomTable("decode", Room)
    assert Stage.HANDSHAKE.value == "bootstrap"  # SGLang's label for the handshake queue
    assert prefill.counts() == {"bootstrap": 0, "waiting": 0, "inflight": 0}
    assert decode.counts() == {"prealloc": 0, "transfer": 0, "waiting": 0, "running": 0}
    assert RoomTable("colocated", Room).stages == QUEUES["decode"]
    prefill.open("a", Stage.HANDSHAKE)
    prefill.open("b", Stage.HANDSHAKE).stage = Stage.INFLIGHT
    assert prefill.counts() == {"bootstrap": 1, "waiting": 0, "inflight": 1}
    decode.open("c", Stage.TRANSFER).stage = Stage.QUARANTINED  # not a queue, still live
    assert decode.counts() == {"prealloc": 0, "transfer": 0, "waiting": 0, "running": 0}
    assert [r.id for r in decode.rooms(Stage.QUARANTINED)] == ["c"] and decode.live() == {"c"}


def test_prefill_remembers_aborted_rooms_and_issued_writes():
    rooms = RoomTable("prefill", PrefillRoom)
    rooms.name_in_abort("early")  # an Abort before its Prefill
    with pytest.raises(RoomInUse):
        rooms.open("early", Stage.HANDSHAKE)
    live = rooms.open("live", Stage.WAITING)
    assert rooms.name_in_abort("live") is live
    rooms.close(issued(live, [7, 8]))
    done = rooms.done("live")
    assert rooms.get("live") is None
    assert done.stage is Stage.DONE and done.aborted and done.checksums == [7, 8]
    with pytest.raises(RoomInUse):
        rooms.open("live", Stage.HANDSHAKE)
    finished = rooms.open("finished", Stage.INFLIGHT)
    rooms.close(issued(finished, [9]))
    assert rooms.done("finished").checksums == [9] and not rooms.done("finished").aborted
    rooms.open("finished", Stage.HANDSHAKE)  # ended normally: the room may be used again
    quiet = rooms.open("quiet", Stage.HANDSHAKE)
    rooms.close(quiet)  # no writes, no Abort: nothing to remember
    assert rooms.get("quiet") is None and rooms.done("quiet") is None
    assert rooms.live() == {"finished"}


def test_the_record_of_done_rooms_is_bounded_and_keeps_live_rooms():
    rooms = RoomTable("prefill", PrefillRoom)
    rooms._remember = 2
    live = rooms.open("live", Stage.WAITING)
    for name in ("a", "b", "c"):
        rooms.name_in_abort(name)
    assert rooms.done("a") is None and rooms.done("b").aborted and rooms.done("c").aborted
    assert rooms.get("live") is live


def test_decode_keeps_no_done_rooms():
    rooms = RoomTable("decode", Room)
    rooms.name_in_abort("x")
    room = rooms.open("x", Stage.PREALLOC)
    rooms.close(room)
    assert rooms.get("x") is None and rooms.done("x") is None


async def test_cleanup_runs_to_its_end_through_a_second_cancellation():
    finished = asyncio.Event()

    async def cleanup():
        await asyncio.sleep(0.05)
        finished.set()
        return "done"

    async def handler():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            return await finish_despite_cancel(cleanup())

    task = asyncio.create_task(handler())
    await asyncio.sleep(0)
    task.cancel()  # the first cancellation starts the cleanup
    await asyncio.sleep(0.01)
    task.cancel()  # a second one (an Abort) arrives while it runs
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished.is_set()
