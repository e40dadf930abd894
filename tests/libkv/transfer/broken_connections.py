"""A `fake` transfer backend whose connections can be made broken, as NIXL's are after it saw
its peer disconnect (every later request answered NIXL_ERR_REMOTE_DISCONNECT). Shared by the
backend's and the prefill service's tests of what happens to such a connection."""

from __future__ import annotations

from libkv.transfer.errors import PeerUnreachable
from libkv.transfer.fake import FakeBackend
from libkv.transfer.grants import Refusal
from libkv.transfer.hooks import Peer, Transfer


class BrokenConnections(FakeBackend):
    """Each connection made while `break_next` is set refuses every request, as NIXL does after
    it saw the peer disconnect; connections made later work."""

    def __init__(self, timeout_s: float = 5.0) -> None:
        super().__init__(timeout_s=timeout_s)
        self.break_next = False
        self.connections = 0

    def _engine_connect(self, endpoint):
        self.connections += 1
        return {"broken": self.break_next}

    def _check(self, peer: Peer) -> None:
        if peer.engine["broken"]:
            raise RuntimeError("NIXL_ERR_REMOTE_DISCONNECT")

    def _engine_write(self, peer: Peer, record: Transfer):
        self._check(peer)
        return super()._engine_write(peer, record)

    def _engine_verify_grant(self, peer: Peer, pages, key, grant, tag) -> Refusal | None:
        try:
            self._check(peer)
        except RuntimeError as exc:
            raise PeerUnreachable(f"fake: reading the grants failed: {exc}") from exc
        return None
