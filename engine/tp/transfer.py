"""KV transfer with tensor-parallel workers: every rank moves its own KV heads, rank to rank.

A TP worker's KV pool is split by KV head over its ranks' processes, so PD between two TP workers
is N transfers at once: prefill rank r writes its pages straight into decode rank r's pages (same
page ids on every rank of a worker, same heads on rank r of both sides), through the transfer
engine each rank registered on its own pool. Nothing is gathered through one process.

Between different TP sizes (engine.tp.kv_map) sender rank i writes to each receiver rank j only the
KV heads they share, as byte pieces of the pages (one-sided engines: mooncake, nixl).

Rank 0 keeps the PD services unchanged by handing them `TPTransferBackend`, which has the
TransferBackend methods they use and fans each call out to a `RankTransfer` per rank: its own, and
over the control channel (engine.tp.control) every follower's. Its endpoint carries the whole
model's KV layout and all ranks' endpoints (the handshake's per-rank endpoints). Every PD worker
uses it, TP 1 included (one rank, its endpoint unchanged), so TP-1 workers can pair with TP-N ones.

Checksums: a page's checksum on a TP worker (`TPKVPool`) is the xxh3 of its ranks' checksums in
rank order, so decode's landing check covers every rank's copy of the page. Between different
sizes both sides compute it over n = max(sizes) equal KV-head parts instead (`checksums_in_parts`):
every rank of either side holds whole parts, so no page is ever gathered in one process.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time
from dataclasses import dataclass, field, replace

import xxhash

from engine.tp.control import RankCallFailed, RankControl
from engine.tp.kv_map import HeadSlice, check_mappable, head_slices, slice_regions
from libkv.layout import KVLayout
from libkv.pool import KVPool
from libkv.transfer import (
    BackendMismatch,
    GrantRefused,
    PeerId,
    PeerUnreachable,
    TransferBackend,
    TransferEndpoint,
    TransferError,
    TransferHandle,
    TransferState,
    create_backend,
)

log = logging.getLogger(__name__)

_TP_BLOB = b"pdserve-tp-endpoints:"  # prefix of a TP worker's endpoint blob
_POLL_FIRST_S = 0.0002
_POLL_MAX_S = 0.002


def combine_checksums(per_rank: list[list[int]]) -> list[int]:
    """One checksum per page from each rank's checksum of its part of the page (rank order)."""
    return [_combine(digests) for digests in zip(*per_rank, strict=True)]


def _combine(digests) -> int:
    return xxhash.xxh3_64_intdigest(b"".join(d.to_bytes(8, "little") for d in digests))


class TPKVPool(KVPool):
    """Rank 0's pool of a TP worker: its own heads, with checksums that cover every rank's heads."""

    def __init__(self, layout: KVLayout, num_pages: int, device, controls: list[RankControl]) -> None:
        super().__init__(layout, num_pages, device)
        self.controls = controls

    @property
    def tp_size(self) -> int:
        return len(self.controls) + 1

    def page_checksums(self, page_ids: list[int]) -> list[int]:
        mine = super().page_checksums(page_ids)
        return combine_checksums([mine, *(c.call("page_checksums", list(page_ids)) for c in self.controls)])

    def poison(self, page_ids: list[int]) -> None:
        super().poison(page_ids)
        for control in self.controls:
            control.call("poison", list(page_ids))

    def part_checksums(self, page_ids: list[int], parts: int) -> list[list[int]]:
        """Per page, the checksums of `parts` equal KV-head parts of the whole model's page."""
        per_rank = parts // self.tp_size
        ranks = [self.head_part_checksums(page_ids, per_rank),
                 *(c.call("head_part_checksums", list(page_ids), per_rank) for c in self.controls)]
        return [[d for rank in ranks for d in rank[k]] for k in range(len(page_ids))]


def checksums_in_parts(pool: KVPool, page_ids: list[int], peer_tp_size: int) -> list[int]:
    """Page checksums as agreed with a peer of TP `peer_tp_size` (see the module doc): the pool's own
    when the sizes are equal, else over max(sizes) KV-head parts."""
    size = pool.tp_size if isinstance(pool, TPKVPool) else 1
    parts = max(size, peer_tp_size)
    if parts == size:
        return pool.page_checksums(page_ids)
    if isinstance(pool, TPKVPool):
        return [_combine(d) for d in pool.part_checksums(page_ids, parts)]
    return [_combine(d) for d in pool.head_part_checksums(page_ids, parts)]


def rank_endpoints(endpoint: TransferEndpoint) -> list[TransferEndpoint]:
    """The endpoints of each rank of the worker behind `endpoint` (one for a TP-1 worker)."""
    if not endpoint.blob.startswith(_TP_BLOB):
        return [endpoint]
    return [TransferEndpoint.from_json(text) for text in json.loads(endpoint.blob[len(_TP_BLOB):])]


class RankTransfer:
    """One rank's transfer engine on its own pool, named by ids so followers can be driven over the
    control channel (rank 0 calls its own directly)."""

    def __init__(self, pool: KVPool, backend: TransferBackend | None = None) -> None:
        self.pool = pool
        self.backend = backend
        self._handles: dict[int, TransferHandle] = {}
        self._lock = threading.Lock()

    def create_backend(self, name: str, options: dict) -> TransferEndpoint:
        self.backend = create_backend(name, **options)
        self.backend.register(self.pool)
        return self.backend.endpoint()

    def connect(self, endpoint: TransferEndpoint, heads_may_differ: bool) -> PeerId:
        return self.backend.connect(endpoint, heads_may_differ=heads_may_differ)  # type: ignore[union-attr]

    def disconnect(self, peer: PeerId) -> None:
        self.backend.disconnect(peer)  # type: ignore[union-attr]

    def verify_grant(self, peer: PeerId, pages: list[int], key: str, grant: bytes) -> None:
        self.backend.verify_grant(peer, pages, key=key, grant=grant)  # type: ignore[union-attr]

    def write(self, peer: PeerId, src: list[int], dst: list[int], key: str, grant: bytes) -> tuple[int, int]:
        return self._keep(self.backend.write(peer, src, dst, key=key, grant=grant))  # type: ignore[union-attr]

    def write_slice(self, peer: PeerId, cut: HeadSlice, src: list[int], dst: list[int], dst_layout: KVLayout,
                    key: str, grant: bytes) -> tuple[int, int]:
        regions = slice_regions(cut, src, dst, self.pool.layout, dst_layout)
        return self._keep(self.backend.write_regions(peer, regions, src, dst, key=key, grant=grant))  # type: ignore[union-attr]

    def _keep(self, handle: TransferHandle) -> tuple[int, int]:
        with self._lock:
            self._handles[handle.transfer_id] = handle
        return handle.transfer_id, handle.nbytes

    def poll(self, transfer_id: int) -> tuple[TransferState, str]:
        """The state, and the error's text once failed; a finished write is forgotten here."""
        with self._lock:
            handle = self._handles.get(transfer_id)
        if handle is None:
            return TransferState.ABORTED, "aborted"
        state = self.backend.poll(handle)  # type: ignore[union-attr]
        if not state.finished:
            return state, ""
        error = self.backend.error(handle)  # type: ignore[union-attr]
        with self._lock:
            self._handles.pop(transfer_id, None)
        return state, str(error) if error else ""

    def abort(self, transfer_id: int) -> TransferState:
        with self._lock:
            handle = self._handles.pop(transfer_id, None)
        if handle is None:  # finished and reported already
            return TransferState.DONE
        return self.backend.abort(handle)  # type: ignore[union-attr]

    def expect(self, key: str, pages: list[int], grant: bytes) -> None:
        self.backend.expect(key, pages, grant=grant)  # type: ignore[union-attr]

    def release_expectation(self, key: str) -> None:
        self.backend.release_expectation(key)  # type: ignore[union-attr]

    def page_checksums(self, pages: list[int]) -> list[int]:
        return self.pool.page_checksums(pages)

    def head_part_checksums(self, pages: list[int], parts: int) -> list[list[int]]:
        return self.pool.head_part_checksums(pages, parts)

    def poison(self, pages: list[int]) -> None:
        self.pool.poison(pages)

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()


@dataclass
class _Peer:
    """A connected worker: its TP size and, per local rank, the (head slice or None for whole
    pages, receiver rank's peer id) links that rank writes through."""

    tp_size: int
    layout: KVLayout  # one receiver rank's page
    links: list[list[tuple[HeadSlice | None, PeerId]]]


@dataclass
class _Write:
    """One composite write: (rank, transfer id) of each part, and the final state of each part."""

    parts: list[tuple[int, int]]
    final: dict[int, tuple[TransferState, str]] = field(default_factory=dict)  # part index -> state


class TPTransferBackend:
    """Rank 0's TransferBackend for a PD worker (see the module doc). Built with rank 0's own
    backend and the followers' controls; `register(pool)` creates every follower's backend."""

    def __init__(self, local: TransferBackend, controls: list[RankControl], name: str, options: dict) -> None:
        self.local = local
        self.controls = controls
        self.name = name
        self.one_sided = local.one_sided
        self.moves_bytes = local.moves_bytes
        self._options = options
        self._rank0: RankTransfer | None = None
        self._endpoints: list[TransferEndpoint] = []
        self._peers: dict[PeerId, _Peer] = {}
        self._by_endpoint: dict[TransferEndpoint, PeerId] = {}
        self._writes: dict[int, _Write] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.bytes_per_rank = [0] * (len(controls) + 1)

    @property
    def size(self) -> int:
        return len(self.controls) + 1

    @property
    def pool(self) -> KVPool | None:
        return self.local.pool

    def register(self, pool: KVPool) -> None:
        self.local.register(pool)
        self._rank0 = RankTransfer(pool, self.local)
        self._endpoints = [self.local.endpoint(),
                           *(c.call("create_backend", self.name, self._options) for c in self.controls)]

    def endpoint(self) -> TransferEndpoint:
        mine = self._endpoints[0]
        if self.size == 1:
            return mine
        blob = _TP_BLOB + json.dumps([e.to_json() for e in self._endpoints]).encode()
        return TransferEndpoint(mine.backend, _whole_model(mine.layout, self.size), mine.host, mine.num_pages, blob)

    # ---- sender side -----------------------------------------------------------------------
    def connect(self, endpoint: TransferEndpoint) -> PeerId:
        with self._lock:
            known = self._by_endpoint.get(endpoint)
        if known is not None:
            return known
        theirs = rank_endpoints(endpoint)
        peer_size, layout = len(theirs), theirs[0].layout
        if peer_size == self.size:
            links = [[(None, self._call(rank, "connect", theirs[rank], False))] for rank in range(self.size)]
        else:
            links = self._connect_slices(theirs)
        peer_id = PeerId(f"tp{self.size}-peer-{next(self._ids)}")
        with self._lock:
            self._peers[peer_id] = _Peer(peer_size, layout, links)  # type: ignore[arg-type]
            self._by_endpoint[endpoint] = peer_id
        return peer_id

    def _connect_slices(self, theirs: list[TransferEndpoint]) -> list[list[tuple[HeadSlice, PeerId]]]:
        mine = self.local.pool.layout  # type: ignore[union-attr]
        heads = mine.num_kv_heads * self.size
        check_mappable(heads, self.size, len(theirs))
        _whole_model(mine, self.size).check_compatible(_whole_model(theirs[0].layout, len(theirs)),
                                                       mine="prefill", theirs="decode")
        if not self.local.writes_regions:
            raise BackendMismatch(f"{self.name} moves whole pages only: KV between --tp-size {self.size} and "
                                  f"--tp-size {len(theirs)} needs mooncake or nixl")
        return [[(cut, self._call(rank, "connect", theirs[cut.dst_rank], True))
                 for cut in head_slices(heads, self.size, len(theirs), rank)] for rank in range(self.size)]

    def disconnect(self, peer: PeerId) -> None:
        with self._lock:
            record = self._peers.pop(peer, None)
            for endpoint, known in list(self._by_endpoint.items()):
                if known == peer:
                    del self._by_endpoint[endpoint]
        if record is not None:
            for rank, links in enumerate(record.links):
                for _, rank_peer in links:
                    self._call(rank, "disconnect", rank_peer)

    def verify_grant(self, peer: PeerId, dst_pages: list[int], *, key: str, grant: bytes = b"") -> None:
        for rank, links in enumerate(self._peer(peer).links):
            for _, rank_peer in links:
                self._call(rank, "verify_grant", rank_peer, list(dst_pages), key, grant)

    def write(self, peer: PeerId, src_pages: list[int], dst_pages: list[int], *,
              key: str = "", grant: bytes = b"") -> TransferHandle:
        record = self._peer(peer)
        write = _Write([])
        sent = [0] * self.size
        try:
            for rank, links in enumerate(record.links):
                for cut, rank_peer in links:
                    if cut is None:
                        transfer_id, nbytes = self._call(rank, "write", rank_peer, list(src_pages), list(dst_pages),
                                                         key, grant)
                    else:
                        transfer_id, nbytes = self._call(rank, "write_slice", rank_peer, cut, list(src_pages),
                                                         list(dst_pages), record.layout, key, grant)
                    write.parts.append((rank, transfer_id))
                    sent[rank] += nbytes
        except TransferError:
            self._abort_parts(write)
            raise
        runs = len(write.parts)
        handle = TransferHandle(next(self._ids), peer, key, len(src_pages), runs, sum(sent))
        with self._lock:
            self._writes[handle.transfer_id] = write
            for rank, nbytes in enumerate(sent):
                self.bytes_per_rank[rank] += nbytes
        return handle

    def page_checksums_for(self, peer: PeerId, page_ids: list[int]) -> list[int]:
        return checksums_in_parts(self.local.pool, page_ids, self._peer(peer).tp_size)  # type: ignore[arg-type]

    def poll(self, handle: TransferHandle) -> TransferState:
        write = self._write(handle)
        states = []
        for index, (rank, transfer_id) in enumerate(write.parts):
            if index not in write.final:
                state, error = self._call(rank, "poll", transfer_id)
                if not state.finished:
                    states.append(state)
                    continue
                write.final[index] = (state, error)
            states.append(write.final[index][0])
        return _combined(states)

    async def wait(self, handle: TransferHandle) -> None:
        delay = _POLL_FIRST_S
        while not (await self._poll_async(handle)).finished:
            await asyncio.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)
        self._finish(handle)

    async def _poll_async(self, handle: TransferHandle) -> TransferState:
        # Followers answer over a socket (a blocking call: off the event loop); a TP-1 worker polls
        # its engine in place, as a plain backend's wait does.
        if self.size == 1:
            return self.poll(handle)
        return await asyncio.to_thread(self.poll, handle)

    def wait_blocking(self, handle: TransferHandle) -> None:
        delay = _POLL_FIRST_S
        while not self.poll(handle).finished:
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)
        self._finish(handle)

    def abort(self, handle: TransferHandle) -> TransferState:
        with self._lock:
            write = self._writes.pop(handle.transfer_id, None)
        if write is None:
            return TransferState.DONE
        return self._abort_parts(write)

    def error(self, handle: TransferHandle) -> TransferError | None:
        write = self._write(handle)
        for index, (state, error) in sorted(write.final.items()):
            if state is not TransferState.DONE:
                rank = write.parts[index][0]
                return PeerUnreachable(f"tp rank {rank}: {error or state.value}" if self.size > 1 else error)
        return None

    # ---- receiver side ---------------------------------------------------------------------
    def expect(self, key: str, dst_pages: list[int], grant: bytes = b"") -> None:
        self.local.expect(key, dst_pages, grant=grant)
        try:
            for control in self.controls:
                control.call("expect", key, list(dst_pages), grant)
        except BaseException:
            self.release_expectation(key)
            raise

    def release_expectation(self, key: str) -> None:
        self.local.release_expectation(key)
        for control in self.controls:
            control.call("release_expectation", key)

    def expected_pages(self, key: str) -> frozenset[int]:
        return self.local.expected_pages(key)

    def close(self) -> None:
        if self.size > 1:
            log.info("KV bytes written per tp rank: %s", ", ".join(
                f"rank {rank} {sent}" for rank, sent in enumerate(self.bytes_per_rank)))
        self.local.close()  # each follower closes its own engine when rank 0 closes the group

    # ---- helpers ---------------------------------------------------------------------------
    def _call(self, rank: int, method: str, *args: object):
        if rank == 0:
            return getattr(self._rank0, method)(*args)
        return _call(self.controls[rank - 1], method, *args)

    def _peer(self, peer: PeerId) -> _Peer:
        with self._lock:
            record = self._peers.get(peer)
        if record is None:
            raise PeerUnreachable(f"unknown or disconnected peer {peer}")
        return record

    def _write(self, handle: TransferHandle) -> _Write:
        with self._lock:
            write = self._writes.get(handle.transfer_id)
        if write is None:
            raise KeyError(f"unknown transfer {handle.transfer_id}")
        return write

    def _finish(self, handle: TransferHandle) -> None:
        error = self.error(handle)
        with self._lock:
            self._writes.pop(handle.transfer_id, None)
        if error is not None:
            raise error

    def _abort_parts(self, write: _Write) -> TransferState:
        states = []
        for index, (rank, transfer_id) in enumerate(write.parts):
            if index in write.final:
                states.append(write.final[index][0])
                continue
            try:
                states.append(self._call(rank, "abort", transfer_id))
            except TransferError:  # the rank is gone: its writes went with it
                states.append(TransferState.ABORTED)
        return _combined(states)


def _whole_model(rank_layout: KVLayout, tp_size: int) -> KVLayout:
    return replace(rank_layout, num_kv_heads=rank_layout.num_kv_heads * tp_size)


def _combined(states: list[TransferState]) -> TransferState:
    for final in (TransferState.FAILED, TransferState.ABORTED, TransferState.PENDING):
        if final in states:
            return final
    return TransferState.DONE


def _call(control: RankControl, method: str, *args: object):
    """A follower call, its failures as the transfer errors the PD services handle."""
    try:
        return control.call(method, *args)
    except RankCallFailed as exc:
        if exc.type_name == "GrantRefused" and exc.detail is not None:
            raise GrantRefused(str(exc), exc.detail) from None  # type: ignore[arg-type]
        raise PeerUnreachable(str(exc)) from None
