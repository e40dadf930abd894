"""The TransferBackend of a worker with DP attention: one backend per DP group, chosen by room.

Under `--enable-dp-attention --dp-size D` a worker's KV is D separate pools, one per attention
group (engine.dp_engine): group g's pages live on its attn_tp_size ranks, with their own page ids,
and a request's pages are all on the group it was placed on. For KV transfer each group is a worker
of TP attn_tp_size of its own, with its own backend over its ranks (the engine's backend at TP 1 for
rank 0's group, libkv.transfer.tensor_parallel otherwise) and its own endpoint. This backend routes
every call that names a room to the group holding that room's pages (`group_of`, the engine's
placement); calls that name a peer fan out, since any group may write to any peer.

Receiver: decode sends the prefill the endpoint of the room's group (`endpoint_for(room)`) with
the room's pages; `expect` records the room's group until `release_expectation`, so a release after
the engine forgot the room still reaches it. Sender: `connect` connects every group to the peer
(one PeerId for all), and writes, grant checks and checksums of a room go through its group's link.
The endpoint in the registry is group 0's: a peer handshakes with it like with any worker of
attn_tp_size ranks, and it is never written to except for group 0's rooms.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from libkv.pool import KVPool
from libkv.transfer.errors import PeerUnreachable
from libkv.transfer.interface import PeerId, TransferBackend, TransferEndpoint, TransferHandle, TransferState


@dataclass(frozen=True)
class _GroupWrite:
    """A write of this backend: the group that made it and that group's handle."""

    group: int
    handle: TransferHandle


class DPGroupsBackend(TransferBackend):
    """One registered backend per DP group (`groups`, in group order) behind one TransferBackend.
    `group_of(room)` is the group a room's pages are on, or None when the engine has no such room."""

    def __init__(self, groups: Sequence[TransferBackend], group_of: Callable[[str], int | None]) -> None:
        if len(groups) < 2:
            raise ValueError("DP attention groups: at least two (one group is a plain worker)")
        self.groups = list(groups)
        self.group_of = group_of
        first = self.groups[0]
        self.name, self.timeout_s = first.name, first.timeout_s
        self.one_sided, self.moves_bytes = first.one_sided, first.moves_bytes
        self._expected: dict[str, int] = {}  # room -> group, from expect() to release_expectation()
        self._peers: dict[PeerId, list[PeerId]] = {}  # our peer -> each group's peer
        self._by_endpoint: dict[TransferEndpoint, PeerId] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    # ---- lifecycle -------------------------------------------------------------------------

    def register(self, pool: KVPool) -> None:
        raise RuntimeError("DP groups' backends are registered one by one, on their groups' pools")

    def endpoint(self) -> TransferEndpoint:
        return self.groups[0].endpoint()

    def endpoint_for(self, key: str) -> TransferEndpoint:
        return self.groups[self._group(key)].endpoint()

    def close(self) -> None:
        for group in self.groups:
            group.close()

    # ---- receiver side ---------------------------------------------------------------------

    def expect(self, key: str, dst_pages: list[int], grant: bytes = b"") -> None:
        group = self._group(key)
        self.groups[group].expect(key, dst_pages, grant=grant)
        with self._lock:
            self._expected[key] = group

    def release_expectation(self, key: str) -> None:
        with self._lock:
            group = self._expected.pop(key, None)
        for backend in self.groups if group is None else [self.groups[group]]:
            backend.release_expectation(key)

    def expected_pages(self, key: str) -> frozenset[int]:
        with self._lock:
            group = self._expected.get(key)
        return frozenset() if group is None else self.groups[group].expected_pages(key)

    # ---- sender side -----------------------------------------------------------------------

    def connect(self, endpoint: TransferEndpoint) -> PeerId:
        with self._lock:
            known = self._by_endpoint.get(endpoint)
        if known is not None:
            return known
        links: list[PeerId] = []
        try:
            for group in self.groups:
                links.append(group.connect(endpoint))
        except BaseException:  # refused or unreachable from one group: keep no link of the others
            for group, link in zip(self.groups, links, strict=False):
                group.disconnect(link)
            raise
        peer = PeerId(f"dp{len(self.groups)}-peer-{next(self._ids)}")
        with self._lock:
            self._peers[peer] = links
            self._by_endpoint[endpoint] = peer
        return peer

    def disconnect(self, peer: PeerId) -> None:
        with self._lock:
            links = self._peers.pop(peer, None)
            for endpoint, known in list(self._by_endpoint.items()):
                if known == peer:
                    del self._by_endpoint[endpoint]
        for group, link in zip(self.groups, links or [], strict=False):
            group.disconnect(link)

    def verify_grant(self, peer: PeerId, dst_pages: list[int], *, key: str, grant: bytes = b"") -> None:
        # Checked before the prompt runs, so before the room is placed on a group: any group's
        # link reads the same grant table of the peer.
        group = self.group_of(key) or 0
        self.groups[group].verify_grant(self._link(peer, group), dst_pages, key=key, grant=grant)

    def write(self, peer: PeerId, src_pages: list[int], dst_pages: list[int], *,
              key: str = "", grant: bytes = b"") -> TransferHandle:
        group = self._group(key)
        inner = self.groups[group].write(self._link(peer, group), src_pages, dst_pages, key=key, grant=grant)
        return TransferHandle(inner.transfer_id, peer, key, inner.num_pages, inner.num_runs, inner.nbytes,
                              _GroupWrite(group, inner))

    def page_checksums_for(self, peer: PeerId, page_ids: list[int], *, key: str = "") -> list[int]:
        group = self._group(key)
        return self.groups[group].page_checksums_for(self._link(peer, group), page_ids, key=key)

    def poll(self, handle: TransferHandle) -> TransferState:
        write = self._write(handle)
        return self.groups[write.group].poll(write.handle)

    async def _poll_on_loop(self, handle: TransferHandle) -> TransferState:
        write = self._write(handle)
        return await self.groups[write.group]._poll_on_loop(write.handle)

    def abort(self, handle: TransferHandle) -> TransferState:
        write = self._write(handle)
        return self.groups[write.group].abort(write.handle)

    def error(self, handle: TransferHandle):
        write = self._write(handle)
        return self.groups[write.group].error(write.handle)

    def rank_bytes(self) -> list[int]:
        """In world rank order: group g's ranks are g * attn_tp_size onwards."""
        return [sent for group in self.groups for sent in group.rank_bytes()]

    # ---- helpers ---------------------------------------------------------------------------

    def _group(self, key: str) -> int:
        group = self.group_of(key)
        if group is None:
            with self._lock:
                group = self._expected.get(key)
        if group is None:
            raise KeyError(f"room {key!r} is on no DP attention group of this worker")
        return group

    def _link(self, peer: PeerId, group: int) -> PeerId:
        with self._lock:
            links = self._peers.get(peer)
        if links is None:
            raise PeerUnreachable(f"unknown or disconnected peer {peer}")
        return links[group]

    @staticmethod
    def _write(handle: TransferHandle) -> _GroupWrite:
        if not isinstance(handle.record, _GroupWrite):
            raise KeyError(f"transfer {handle.transfer_id} was not made by a write() of this backend")
        return handle.record
