"""`fake` backend: moves nothing and checks nothing. For control-plane tests only, never for
output checks."""

from __future__ import annotations

import json
from typing import Any

from libkv.pool import KVPool
from libkv.transfer.base import EngineBackend
from libkv.transfer.grants import Refusal
from libkv.transfer.hooks import Peer, Transfer
from libkv.transfer.interface import TransferEndpoint, TransferState


class FakeBackend(EngineBackend):
    """Every write is DONE as soon as it is issued and no byte moves.

    It still validates like a real backend (layouts, page ranges, dead peers, abort, timeouts
    do not apply), so the PD services' handshake and state machines can be tested without an
    engine. `writes` counts issued writes and `runs_written` their page runs, for assertions.
    Its receiver keeps a grant table like every backend (expect() binds, release zeroes), but
    verify_grant() is a no-op: the fake sender has no engine to read the peer's table through.
    """

    name = "fake"
    moves_bytes = False

    def __init__(self, *, timeout_s: float = 30.0, host: str = "127.0.0.1") -> None:
        super().__init__(timeout_s=timeout_s, host=host)
        self.writes = 0
        self.runs_written = 0

    def _engine_register(self, pool: KVPool) -> None:
        pass

    def _engine_blob(self) -> bytes:
        return json.dumps({"fake": True}).encode()

    def _engine_connect(self, endpoint: TransferEndpoint) -> Any:
        return None

    def _engine_write(self, peer: Peer, record: Transfer) -> Any:
        self.writes += 1
        self.runs_written += len(record.runs)
        return None

    def _engine_progress(self, record: Transfer) -> TransferState:
        return TransferState.DONE

    def _engine_verify_grant(self, peer: Peer, pages: list[int], key: str, grant: bytes,
                             tag: bytes) -> Refusal | None:
        return None  # checks nothing: see the class docstring

    def _engine_cancel(self, record: Transfer, deadline: float) -> None:
        pass
