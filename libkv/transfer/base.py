"""EngineBackend: the machinery every engine's TransferBackend builds on (mooncake, nixl, ucx, fake).

It owns validation, page-run coalescing, the table of unfinished transfers, timeouts, dead peers,
the receiver's grant table and expectations, and the thread safety of all of it; an engine only
implements the hooks of libkv.transfer.hooks. A write passes write() and one engine hook.

Its peers (engine connections, and peers of another tensor-parallel size: which connections a
write to them fans out to) are libkv.transfer.peers'.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import ClassVar

from libkv.landing import sent_checksums
from libkv.layout import KVLayout
from libkv.pool import ByteRun, KVPool, PageRun, coalesce
from libkv.transfer.errors import (
    BackendMismatch,
    GrantRefused,
    PeerUnreachable,
    TransferAborted,
    TransferError,
    TransferTimeout,
)
from libkv.transfer.grants import GrantTable, check_grant, grant_tag
from libkv.transfer.head_map import HeadSlice, slice_regions
from libkv.transfer.hooks import EngineHooks, Peer, Transfer
from libkv.transfer.interface import PeerId, TransferBackend, TransferEndpoint, TransferHandle, TransferState
from libkv.transfer.peers import PeerTable, check_stages, links_to_other_size

log = logging.getLogger(__name__)


class EngineBackend(EngineHooks, TransferBackend):
    """A TransferBackend over one transfer engine; subclasses implement the `_engine_*` hooks."""

    name: str
    one_sided: bool = True
    moves_bytes: bool = True  # False only for `fake`: there is nothing to checksum
    # Engines that write any list of byte regions (one-sided RMA), so can write pieces of pages
    # to a peer that splits the KV heads another way; UCX's protocol moves whole pages.
    writes_regions: ClassVar[bool] = False
    # Whether the engine reads and writes a pool in GPU memory (a CUDA build of it); False: host only.
    device_memory: ClassVar[bool] = False

    def __init__(self, *, timeout_s: float = 30.0, host: str = "127.0.0.1") -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self.host = host
        self.pool: KVPool | None = None
        self.tp_rank, self.tp_size = 0, 1
        self.pp_size = 1
        self._lock = threading.RLock()
        self._transfers: dict[int, Transfer] = {}  # unfinished writes, for close() / disconnect()
        self._ids = itertools.count(1)  # transfer ids, peer ids and engine request ids
        self._peers = PeerTable(self.name, self._lock, self._ids)
        self.grants: GrantTable | None = None  # set by register(); see libkv.transfer.grants
        self._bytes_written = 0
        self._closed = False

    # ---- lifecycle -------------------------------------------------------------------------

    def register(self, pool: KVPool, *, tp_rank: int = 0, tp_size: int = 1, pp_size: int = 1) -> None:
        """Register the pool's memory with the engine. Call once, before endpoint/connect/write.
        `tp_rank` of `tp_size`: which share of the model's KV heads the pool holds (a TP rank's).
        With `pp_size` pipeline stages they are the world rank and world size (tp * pp ranks) and
        the pool holds its stage's layers: such a worker pairs only with one of the same layout."""
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp rank {tp_rank} of {tp_size}")
        with self._lock:
            if self.pool is not None:
                raise RuntimeError(f"{self.name} backend already has a registered pool")
            if pool.device.type != "cpu" and not self.supports_device_memory():
                raise ValueError(f"{self.name} backend here supports host memory only, got {pool.device} "
                                 f"(a pool in GPU memory needs a CUDA build of the {self.name} engine)")
            self.grants = GrantTable(pool.num_pages)  # the engine registers it next to the pool
            self._engine_register(pool)
            self.pool = pool
            self.tp_rank, self.tp_size = tp_rank, tp_size
            self.pp_size = pp_size

    @classmethod
    def supports_device_memory(cls) -> bool:
        """Whether the engine installed here moves pages of a pool in GPU memory (see `device_memory`;
        an engine whose CPU and CUDA builds share one module answers by looking at the build)."""
        return cls.device_memory

    def endpoint(self) -> TransferEndpoint:
        pool = self._require_pool()
        return TransferEndpoint(self.name, pool.layout, self.host, pool.num_pages, self._engine_blob())

    def connect(self, endpoint: TransferEndpoint) -> PeerId:
        """See TransferBackend.connect; libkv.transfer.peers says what a peer of another TP size gets.

        A prefill connects once per request: an endpoint already connected returns the same
        peer while it is usable (without this, every request would repeat the engine handshake
        and leave one more peer behind); a peer declared dead is replaced.
        """
        pool = self._require_pool()
        if endpoint.backend != self.name:
            raise BackendMismatch(f"transfer backend mismatch (local vs remote): {self.name} vs "
                                  f"{endpoint.backend}")
        ranks = endpoint.ranks()
        check_stages(self.pp_size, self.tp_size, endpoint.pp_size(), len(ranks))
        if len(ranks) == self.tp_size:
            return self._connect_rank(ranks[self.tp_rank], pool.layout)
        plan = links_to_other_size(self.name, self.writes_regions, pool.layout, self.tp_rank, self.tp_size,
                                   ranks)
        links = [(link.cut, self._connect_rank(link.endpoint, link.layout)) for link in plan]
        return self._peers.route(endpoint, len(ranks), links)

    def _connect_rank(self, endpoint: TransferEndpoint, mine: KVLayout) -> PeerId:
        """One engine connection to the pool behind a (one-rank) endpoint whose layout must
        equal `mine`."""
        mine.check_compatible(endpoint.layout, mine="local", theirs=f"remote {endpoint.host}")
        existing, dead = self._peers.live_for(endpoint)
        for stale in dead:  # forget dead peers on the way
            self.disconnect(stale.peer_id)
        if existing is not None:
            return existing
        peer = Peer(self._peers.new_id(), endpoint)
        # Not under the backend lock: an engine handshake may wait on the engine's own thread,
        # which takes the lock to serve incoming transfers.
        peer.engine = self._engine_connect(endpoint)
        winner = self._peers.add(peer)
        if winner != peer.peer_id:  # another thread connected the same endpoint meanwhile
            self._engine_disconnect(peer)
        return winner

    def disconnect(self, peer_id: PeerId) -> None:
        """Forget a peer (e.g. its lease expired). Its unfinished transfers are aborted."""
        route = self._peers.remove_route(peer_id)
        for link in [peer_id] if route is None else [link for _, link in route.links]:
            for record in [t for t in list(self._transfers.values()) if t.handle.peer == link]:
                self.abort(record.handle)
            peer = self._peers.remove(link)
            if peer is not None:
                self._engine_disconnect(peer)

    def close(self) -> None:
        """Abort what is in flight, then release the engine. The backend is unusable afterwards."""
        if self._closed:
            return
        for record in list(self._transfers.values()):
            self.abort(record.handle)
        with self._lock:
            self._closed = True
            peers = self._peers.clear()
        for peer in peers:
            try:
                self._engine_disconnect(peer)
            except Exception:  # closing must not fail because one peer is already gone
                log.exception("%s: disconnecting %s failed", self.name, peer.peer_id)
        self._engine_close()

    # ---- receiver side ---------------------------------------------------------------------

    def expect(self, key: str, dst_pages: list[int], grant: bytes = b"") -> None:
        pool = self._require_pool()
        bad = [p for p in dst_pages if not 0 <= p < pool.num_pages]
        if bad:
            raise IndexError(f"expect({key!r}): pages {bad[:8]} outside pool of {pool.num_pages} pages")
        tag = grant_tag(key, grant)
        grants = self._require_grants()
        with self._lock:  # the two-sided receiver checks incoming writes against the table under it
            self._engine_expect(key, grants.expect(key, dst_pages, tag))

    def release_expectation(self, key: str) -> None:
        grants = self._require_grants()
        with self._lock:
            pages = grants.release(key)
        if pages is not None:
            self._engine_release(key, pages)

    def expected_pages(self, key: str) -> frozenset[int]:
        with self._lock:
            return self.grants.expected(key) if self.grants is not None else frozenset()

    # ---- sender side -----------------------------------------------------------------------

    def verify_grant(self, peer: PeerId, dst_pages: list[int], *, key: str, grant: bytes = b"") -> None:
        """See TransferBackend.verify_grant: one engine read per few thousand pages (more only
        for widely scattered pages) and per engine connection of the peer."""
        tag = grant_tag(key, grant)
        links = self._links(peer)
        for _cut, target in links:
            _check_pages("destination", dst_pages, target.endpoint.num_pages)
        if not dst_pages:
            return
        grant = check_grant(grant)
        for _cut, target in links:
            try:
                refusal = self._engine_verify_grant(target, list(dst_pages), key, grant, tag)
            except PeerUnreachable as exc:
                self._peers.declare_dead(target.peer_id, exc)
                raise
            if refusal is not None:
                raise GrantRefused(
                    f"{self.name} peer {target.peer_id} ({target.endpoint.host}) did not reserve page "
                    f"{refusal.first_page} for key {key!r} and this grant "
                    f"({refusal.count} of {refusal.total} pages refused)", refusal)

    def write(self, peer: PeerId, src_pages: list[int], dst_pages: list[int], *,
              key: str = "", grant: bytes = b"") -> TransferHandle:
        """See TransferBackend.write. Consecutive pages on both sides coalesce into one run, and
        each run is one engine write (the pool is page-major, so a run is one contiguous region
        on each side). To a peer of another TP size: one engine write per connection, of the byte
        regions of the heads it carries (MLA: whole pages, to each peer rank this rank writes)."""
        pool = self._require_pool()
        grant = check_grant(grant)
        runs = coalesce(list(src_pages), list(dst_pages))
        links = self._links(peer)
        _check_pages("source", src_pages, pool.num_pages)
        for _cut, target in links:
            _check_pages("destination", dst_pages, target.endpoint.num_pages)
        parts = []
        for cut, target in links:
            pieces: list[PageRun] | list[ByteRun] = runs
            nbytes = len(src_pages) * pool.layout.page_nbytes
            if cut is not None:
                pieces = slice_regions(cut, list(src_pages), list(dst_pages), pool.layout,
                                       target.endpoint.layout)
                nbytes = sum(region.nbytes for region in pieces)
            record = Transfer(pieces, time.monotonic() + self.timeout_s, owner=id(self), grant=grant)
            record.handle = TransferHandle(next(self._ids), target.peer_id, key, len(src_pages), len(pieces),
                                           nbytes, record)
            parts.append(record)
            if not pieces:
                record.state = TransferState.DONE
                continue
            with self._lock:
                self._transfers[record.handle.transfer_id] = record
                self._bytes_written += nbytes
            try:
                record.engine = self._engine_write(target, record)
            except Exception as exc:  # an engine refusing a request is a failed transfer, not a crash
                error = (exc if isinstance(exc, TransferError)
                         else PeerUnreachable(f"{self.name} write failed: {exc}"))
                if isinstance(error, PeerUnreachable):
                    self._peers.declare_dead(target.peer_id, error)
                self._finish(record, TransferState.FAILED, error)
        if len(parts) == 1:
            return parts[0].handle
        group = Transfer([], 0.0, owner=id(self), parts=parts)
        if not parts:  # an MLA rank that is no peer rank's writer: nothing to move, done
            group.state = TransferState.DONE
        group.handle = TransferHandle(next(self._ids), peer, key, len(src_pages),
                                      sum(p.handle.num_runs for p in parts),
                                      sum(p.handle.nbytes for p in parts), group)
        return group.handle

    def page_checksums_for(self, peer: PeerId, page_ids: list[int], *, key: str = "") -> list[int]:
        route = self._peers.route_of(peer)
        return sent_checksums(self._require_pool(), page_ids, route.tp_size if route else self.tp_size)

    def poll(self, handle: TransferHandle) -> TransferState:
        record = self._record(handle)
        if record.parts:
            return TransferState.combined([self._advance(part) for part in record.parts])
        return self._advance(record)

    def abort(self, handle: TransferHandle) -> TransferState:
        record = self._record(handle)
        if record.parts:
            return TransferState.combined([self._stop(part) for part in record.parts])
        return self._stop(record)

    def error(self, handle: TransferHandle) -> TransferError | None:
        record = self._record(handle)
        ended = [part for part in record.parts or [record] if part.state.finished and part.error is not None]
        return ended[0].error if ended else None

    def rank_bytes(self) -> list[int]:
        return [self._bytes_written]

    def _pause(self, handle: TransferHandle, seconds: float) -> None:
        self._record(handle).wakeup.wait(seconds)

    # ---- one engine write --------------------------------------------------------------------

    def _advance(self, record: Transfer) -> TransferState:
        """poll() of one engine write: non-blocking; past the deadline it becomes FAILED."""
        if record.state.finished:
            return record.state
        handle = record.handle
        with record.lock:
            if record.state.finished:
                return record.state
            try:
                progress = self._engine_progress(record)
            except TransferError as exc:
                self._fail_locked(record, exc)
                return record.state
            if progress is TransferState.DONE:
                self._finish(record, TransferState.DONE, None)
            elif progress is TransferState.FAILED:
                self._fail_locked(record, record.error or PeerUnreachable(
                    f"{self.name} write to {handle.peer} failed in the engine"))
            elif time.monotonic() > record.deadline:
                self._fail_locked(record, TransferTimeout(
                    f"{self.name} write {handle.transfer_id} ({handle.nbytes} bytes) to {handle.peer} "
                    f"not done after {self.timeout_s:g} s; peer declared dead"), timed_out=True)
        return record.state

    def _stop(self, record: Transfer) -> TransferState:
        """abort() of one engine write."""
        handle = record.handle
        with record.lock:
            if record.state.finished:
                return record.state
            try:
                self._engine_cancel(record, time.monotonic() + self.timeout_s)
            except Exception:
                log.exception("%s: cancelling transfer %d failed", self.name, handle.transfer_id)
            self._finish(record, TransferState.ABORTED,
                         TransferAborted(f"{self.name} write {handle.transfer_id} to {handle.peer} aborted"))
        return record.state

    def _finish(self, record: Transfer, state: TransferState, error: TransferError | None) -> None:
        record.state, record.error = state, error
        with self._lock:
            self._transfers.pop(record.handle.transfer_id, None)
        try:
            self._engine_release_transfer(record)
        except Exception:
            log.exception("%s: releasing transfer %d failed", self.name, record.handle.transfer_id)

    def _fail_locked(self, record: Transfer, error: TransferError, *, timed_out: bool = False) -> None:
        """Fail a transfer whose lock is held: cancel what is still in flight, and on a timeout or
        an unreachable peer declare the peer dead (see PeerTable.declare_dead)."""
        # A timed-out peer is presumed dead: give in-flight operations a short grace, not another
        # full timeout.
        grace = 1.0 if timed_out else min(self.timeout_s, 5.0)
        try:
            self._engine_cancel(record, time.monotonic() + grace)
        except Exception:
            log.exception("%s: cancelling failed transfer %d", self.name, record.handle.transfer_id)
        if timed_out or isinstance(error, PeerUnreachable):
            self._peers.declare_dead(record.handle.peer, error)
        self._finish(record, TransferState.FAILED, error)

    # ---- helpers ---------------------------------------------------------------------------

    def _links(self, peer: PeerId) -> list[tuple[HeadSlice | None, Peer]]:
        """The usable engine connections a write to `peer` goes through, with the heads each
        carries (None: whole pages); raises PeerUnreachable if one of them is not usable."""
        return [(cut, self._usable_peer(link)) for cut, link in self._peers.links(peer)]

    def _usable_peer(self, peer: PeerId) -> Peer:
        self._require_pool()
        with self._lock:
            if self._closed:
                raise TransferAborted(f"{self.name} backend is closed")
            return self._peers.usable(peer)

    def _record(self, handle: TransferHandle) -> Transfer:
        record = handle.record
        if not isinstance(record, Transfer) or record.owner != id(self):
            raise KeyError(f"transfer {handle.transfer_id} was not made by a write() of this backend")
        return record


def _check_pages(side: str, pages: list[int], num_pages: int) -> None:
    bad = [p for p in pages if not 0 <= p < num_pages]
    if bad:
        raise IndexError(f"{side} pages {bad[:8]} outside a pool of {num_pages} pages")
    if side == "destination" and len(set(pages)) != len(pages):
        raise ValueError("destination pages repeat: each page may be written once per transfer")
