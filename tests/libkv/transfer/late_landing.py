"""An in-process one-sided backend whose writes can land late, as Mooncake's TCP transport's do:
the sender's write is done once the bytes are sent, and they reach the receiver's pool later.
Tests use it to hold a write's bytes until they choose (`hold_writes`, then `land`), so what
decode does while bytes are still on their way is observable without racing a real network."""

from __future__ import annotations

import itertools
import json
import threading
from dataclasses import dataclass

import numpy

from libkv.pool import KVPool
from libkv.transfer.base import EngineBackend
from libkv.transfer.grants import Refusal, compare_entries
from libkv.transfer.hooks import Peer, Transfer
from libkv.transfer.interface import TransferEndpoint, TransferState

_RECEIVERS: dict[int, LateLandingBackend] = {}  # every backend of this process, by id
_ids = itertools.count(1)


@dataclass
class HeldWrite:
    """Bytes sent but not landed: (destination byte offset, the bytes as they were sent)."""

    target: LateLandingBackend
    pieces: list[tuple[int, numpy.ndarray]]


class LateLandingBackend(EngineBackend):
    """Copies a write's bytes into the peer's pool at once, or, while `hold_writes` is set, keeps
    them (as sent) until `land()`. Either way the write is done at once, as a sender sees it."""

    name = "late-landing"

    def __init__(self, *, timeout_s: float = 10.0) -> None:
        super().__init__(timeout_s=timeout_s)
        self.id = next(_ids)
        self.hold_writes = False
        self.held: list[HeldWrite] = []
        self.sent: list[HeldWrite] = []  # every write, landed or held, in the order sent
        self.written = threading.Event()  # set whenever a write was issued

    def _engine_register(self, pool: KVPool) -> None:
        _RECEIVERS[self.id] = self

    def _engine_blob(self) -> bytes:
        return json.dumps({"id": self.id}).encode()

    def _engine_connect(self, endpoint: TransferEndpoint):
        return _RECEIVERS[json.loads(endpoint.blob)["id"]]

    def _engine_write(self, peer: Peer, record: Transfer):
        target: LateLandingBackend = peer.engine
        source = self._require_pool().as_bytes().numpy()
        pieces = []
        for run in record.runs:
            src, dst, nbytes = self._run_bytes(run)
            pieces.append((dst, source[src:src + nbytes].copy()))  # sent: later changes do not travel
        write = HeldWrite(target, pieces)
        self.sent.append(write)
        if self.hold_writes:
            self.held.append(write)
        else:
            _land(write)
        self.written.set()
        return None

    def land(self) -> None:
        """Deliver every held write, in the order they were sent."""
        held, self.held = self.held, []
        for write in held:
            _land(write)

    def _engine_progress(self, record: Transfer) -> TransferState:
        return TransferState.DONE

    def _engine_cancel(self, record: Transfer, deadline: float) -> None:
        pass  # sent bytes cannot be recalled

    def _engine_verify_grant(self, peer: Peer, pages: list[int], key: str, grant: bytes,
                             tag: bytes) -> Refusal | None:
        target: LateLandingBackend = peer.engine
        return compare_entries(target.grants.owners(pages), pages, tag)

    def _engine_close(self) -> None:
        _RECEIVERS.pop(self.id, None)


def _land(write: HeldWrite) -> None:
    pool = write.target._require_pool().as_bytes().numpy()
    for dst, data in write.pieces:
        pool[dst:dst + len(data)] = data
