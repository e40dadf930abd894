"""KV transfer with tensor-parallel workers: every rank moves its own KV heads, rank to rank.

A TP worker's KV pool is split by KV head over its ranks' processes, so PD between two TP workers
is N transfers at once: prefill rank r writes its pages straight into decode rank r's pages (same
page ids on every rank of a worker, same heads on rank r of both sides), through the transfer
engine each rank registered on its own pool. Nothing is gathered through one process.

Rank 0 keeps the PD services unchanged by handing them `TPTransferBackend`, which has the
TransferBackend methods they use and fans each call out to its own backend and, over the control
channel (engine.tp.control), to `RankTransfer` in every follower. Its endpoint carries all ranks'
endpoints (the handshake's per-rank endpoints); connecting to a worker of another TP size is
refused naming both sizes (moving KV between different head splits is not implemented).
A page's checksum on a TP worker (`TPKVPool`) is the xxh3 of its ranks' checksums in rank order,
so decode's landing check covers every rank's copy of the page.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time

import xxhash

from engine.tp.control import RankCallFailed, RankControl
from libkv.layout import KVLayout, LayoutMismatch
from libkv.pool import KVPool
from libkv.transfer import (
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
    return [xxhash.xxh3_64_intdigest(b"".join(d.to_bytes(8, "little") for d in digests))
            for digests in zip(*per_rank, strict=True)]


class TPKVPool(KVPool):
    """Rank 0's pool of a TP worker: its own heads, with checksums that cover every rank's heads."""

    def __init__(self, layout: KVLayout, num_pages: int, device, controls: list[RankControl]) -> None:
        super().__init__(layout, num_pages, device)
        self.controls = controls

    def page_checksums(self, page_ids: list[int]) -> list[int]:
        mine = super().page_checksums(page_ids)
        return combine_checksums([mine, *(c.call("page_checksums", list(page_ids)) for c in self.controls)])


def rank_endpoints(endpoint: TransferEndpoint) -> list[TransferEndpoint]:
    """The endpoints of each rank of the worker behind `endpoint` (one for a TP-1 worker)."""
    if not endpoint.blob.startswith(_TP_BLOB):
        return [endpoint]
    return [TransferEndpoint.from_json(text) for text in json.loads(endpoint.blob[len(_TP_BLOB):])]


def check_tp_sizes(size: int, peer_size: int, *, mine: str = "local", theirs: str = "remote") -> None:
    """Refuse a peer whose KV heads are split another way, naming both TP sizes."""
    if size != peer_size:
        raise LayoutMismatch(f"tensor-parallel size mismatch ({mine} vs {theirs}): --tp-size {size} vs "
                             f"{peer_size}; KV moves only between workers with the same --tp-size")


class RankTransfer:
    """A follower's transfer engine on its own pool, driven by rank 0 (the control channel's handler)."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.backend: TransferBackend | None = None
        self._handles: dict[int, TransferHandle] = {}
        self._lock = threading.Lock()

    def create_backend(self, name: str, options: dict) -> TransferEndpoint:
        self.backend = create_backend(name, **options)
        self.backend.register(self.pool)
        return self.backend.endpoint()

    def connect(self, endpoint: TransferEndpoint) -> PeerId:
        return self.backend.connect(endpoint)  # type: ignore[union-attr]

    def disconnect(self, peer: PeerId) -> None:
        self.backend.disconnect(peer)  # type: ignore[union-attr]

    def verify_grant(self, peer: PeerId, pages: list[int], key: str, grant: bytes) -> None:
        self.backend.verify_grant(peer, pages, key=key, grant=grant)  # type: ignore[union-attr]

    def write(self, peer: PeerId, src: list[int], dst: list[int], key: str, grant: bytes) -> tuple[int, int]:
        handle = self.backend.write(peer, src, dst, key=key, grant=grant)  # type: ignore[union-attr]
        with self._lock:
            self._handles[handle.transfer_id] = handle
        return handle.transfer_id, handle.nbytes

    def poll(self, transfer_id: int) -> tuple[TransferState, str]:
        """The state, and the error's text once failed; a finished write is forgotten here."""
        handle = self._handles[transfer_id]
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

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()


class _Write:
    """One composite write: rank 0's handle and each follower's transfer id (with final states)."""

    def __init__(self, local: TransferHandle, remote: list[tuple[RankControl, int]]) -> None:
        self.local = local
        self.remote = remote
        self.remote_final: dict[int, tuple[TransferState, str]] = {}


class TPTransferBackend:
    """Rank 0's TransferBackend for a TP worker (see the module doc). Built with rank 0's own
    backend and the followers' controls; `register(pool)` creates every follower's backend."""

    def __init__(self, local: TransferBackend, controls: list[RankControl], name: str, options: dict) -> None:
        self.local = local
        self.controls = controls
        self.name = name
        self.one_sided = local.one_sided
        self.moves_bytes = local.moves_bytes
        self._options = options
        self._endpoints: list[TransferEndpoint] = []
        self._peers: dict[PeerId, list[PeerId]] = {}
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
        self._endpoints = [self.local.endpoint(),
                           *(c.call("create_backend", self.name, self._options) for c in self.controls)]

    def endpoint(self) -> TransferEndpoint:
        mine = self._endpoints[0]
        blob = _TP_BLOB + json.dumps([e.to_json() for e in self._endpoints]).encode()
        return TransferEndpoint(mine.backend, mine.layout, mine.host, mine.num_pages, blob)

    # ---- sender side -----------------------------------------------------------------------
    def connect(self, endpoint: TransferEndpoint) -> PeerId:
        theirs = rank_endpoints(endpoint)
        check_tp_sizes(self.size, len(theirs), theirs=f"remote {endpoint.host}")
        with self._lock:
            known = self._by_endpoint.get(endpoint)
        if known is not None:
            return known
        peers = [self.local.connect(theirs[0])]
        peers += [_call(c, "connect", theirs[c.rank]) for c in self.controls]
        peer_id = PeerId(f"tp{self.size}-peer-{next(self._ids)}")
        with self._lock:
            self._peers[peer_id] = peers  # type: ignore[assignment]
            self._by_endpoint[endpoint] = peer_id
        return peer_id

    def disconnect(self, peer: PeerId) -> None:
        with self._lock:
            peers = self._peers.pop(peer, None)
            for endpoint, known in list(self._by_endpoint.items()):
                if known == peer:
                    del self._by_endpoint[endpoint]
        if peers:
            self.local.disconnect(peers[0])
            for control in self.controls:
                _call(control, "disconnect", peers[control.rank])

    def verify_grant(self, peer: PeerId, dst_pages: list[int], *, key: str, grant: bytes = b"") -> None:
        peers = self._rank_peers(peer)
        self.local.verify_grant(peers[0], dst_pages, key=key, grant=grant)
        for control in self.controls:
            _call(control, "verify_grant", peers[control.rank], list(dst_pages), key, grant)

    def write(self, peer: PeerId, src_pages: list[int], dst_pages: list[int], *,
              key: str = "", grant: bytes = b"") -> TransferHandle:
        peers = self._rank_peers(peer)
        local = self.local.write(peers[0], src_pages, dst_pages, key=key, grant=grant)
        remote: list[tuple[RankControl, int]] = []
        nbytes = [local.nbytes]
        try:
            for control in self.controls:
                transfer_id, sent = _call(control, "write", peers[control.rank], list(src_pages),
                                          list(dst_pages), key, grant)
                remote.append((control, transfer_id))
                nbytes.append(sent)
        except TransferError:
            self._abort_parts(_Write(local, remote))
            raise
        handle = TransferHandle(next(self._ids), peer, key, local.num_pages, local.num_runs, sum(nbytes))
        with self._lock:
            self._writes[handle.transfer_id] = _Write(local, remote)
            for rank, sent in enumerate(nbytes):
                self.bytes_per_rank[rank] += sent
        return handle

    def poll(self, handle: TransferHandle) -> TransferState:
        write = self._write(handle)
        states = [self.local.poll(write.local)]
        for control, transfer_id in write.remote:
            if control.rank not in write.remote_final:
                state, error = _call(control, "poll", transfer_id)
                if not state.finished:
                    states.append(state)
                    continue
                write.remote_final[control.rank] = (state, error)
            states.append(write.remote_final[control.rank][0])
        return _combined(states)

    async def wait(self, handle: TransferHandle) -> None:
        delay = _POLL_FIRST_S
        while not (await asyncio.to_thread(self.poll, handle)).finished:
            await asyncio.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)
        self._finish(handle)

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
        local = self.local.error(write.local)
        if local is not None:
            return local
        for rank, (state, error) in sorted(write.remote_final.items()):
            if state is not TransferState.DONE:
                return PeerUnreachable(f"tp rank {rank}: {error or state.value}")
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
        log.info("KV bytes written per tp rank: %s", ", ".join(
            f"rank {rank} {sent}" for rank, sent in enumerate(self.bytes_per_rank)))
        self.local.close()  # each follower closes its own engine when rank 0 closes the group

    # ---- helpers ---------------------------------------------------------------------------
    def _rank_peers(self, peer: PeerId) -> list[PeerId]:
        with self._lock:
            peers = self._peers.get(peer)
        if peers is None:
            raise PeerUnreachable(f"unknown or disconnected peer {peer}")
        return peers

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
        states = [self.local.abort(write.local)]
        for control, transfer_id in write.remote:
            if control.rank in write.remote_final:
                states.append(write.remote_final[control.rank][0])
            else:
                try:
                    states.append(control.call("abort", transfer_id))
                except RankCallFailed:  # the rank is gone: its writes went with it
                    states.append(TransferState.ABORTED)
        return _combined(states)


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
