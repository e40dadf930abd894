"""DecodeRoom: what a decode worker keeps for one request in its room table (services/worker/rooms.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from engine.page_manager import Reservation
from services.decode.prefill_client import PrefillReply
from services.worker.rooms import Room


@dataclass(eq=False)
class DecodeRoom(Room):
    """What a decode worker keeps for one request: the pages reserved for its prompt (`tail` is
    offered to the prefill), and while the Prefill call is open, the call, the prefill it went to
    (address and registry worker id, "" when the registry had not told yet) and why it was given
    up on (`lost`). `local`: the prompt runs on this worker (conditional disaggregation)."""

    local: bool = False
    reservation: Reservation | None = None
    prefill_address: str = ""
    prefill_id: str = ""
    call: asyncio.Future[PrefillReply] | None = None
    lost: str = ""
