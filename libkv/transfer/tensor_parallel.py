"""The TransferBackend of a tensor-parallel worker (TP size > 1): its ranks' backends as one.

A TP worker's KV pool is split by KV head over its ranks' processes (MLA: each rank holds the whole
latent), and each rank registers its own pool with its own transfer engine: an EngineBackend that
knows its rank (libkv.transfer.base), connects to a peer of any TP size (libkv.transfer.peers) and
writes its own heads (MLA: whole pages, to the peer ranks it is the writer of) straight into the
peer's ranks' pages. Nothing is gathered through one process. This backend only fans each call out
over the LOCAL ranks: rank 0's backend in this process, the followers' over the RankChannel each
one answers on (libkv.rank_channel; engine.tp serves a `RankTransfer` there). A TP-1 worker uses
its engine's backend alone: that one pairs with TP-N peers by itself.

Endpoint: the whole model's KV layout, with every rank's endpoint in the blob
(TransferEndpoint.of_ranks). Checksums: rank 0's pool is a libkv.landing.TPKVPool, whose page
checksums cover every rank's heads. `rank_bytes` counts what each rank shipped: for MLA a rank
that writes to no peer rank ships nothing, so their sum is each page once per peer rank.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from libkv.landing import sent_checksums
from libkv.pool import KVPool
from libkv.rank_channel import InProcessRank, RankCallFailed, RankChannel
from libkv.transfer import backend_class, create_backend
from libkv.transfer.base import EngineBackend
from libkv.transfer.errors import GrantRefused, PeerUnreachable, TransferError
from libkv.transfer.interface import PeerId, TransferBackend, TransferEndpoint, TransferHandle, TransferState


class RankTransfer:
    """One rank's backend on its own pool, its writes named by ids so that rank 0 can drive it
    through a RankChannel (rank 0's own in-process). Also serves the TPKVPool's calls for the
    rank's pool (checksums, poison)."""

    def __init__(self, pool: KVPool, rank: int, tp_size: int, pp_size: int = 1,
                 backend: EngineBackend | None = None, bind_host: str | None = None) -> None:
        """`rank` of `tp_size`: the world rank and size (tp * pp ranks) with `pp_size` stages."""
        self.pool = pool
        self.rank, self.tp_size, self.pp_size = rank, tp_size, pp_size
        self.backend = backend
        self.bind_host = bind_host  # a rank on another node than rank 0 binds its own node's address
        self._handles: dict[int, TransferHandle] = {}
        self._lock = threading.Lock()

    def create_backend(self, name: str, options: dict) -> TransferEndpoint:
        if self.bind_host:
            options = {**options, "host": self.bind_host}
        self.backend = create_backend(name, **options)
        self.backend.register(self.pool, tp_rank=self.rank, tp_size=self.tp_size, pp_size=self.pp_size)
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

    def expected_pages(self, key: str) -> frozenset[int]:
        return self.backend.expected_pages(key)  # type: ignore[union-attr]

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
    """A connected worker: its TP size and each local rank's PeerId for it."""

    tp_size: int
    links: list[PeerId]


@dataclass(eq=False)
class _Write:
    """One write of this backend (its handle's record): (rank, transfer id) of each rank's part,
    and the final state (with the error's text) of each part known to be finished."""

    parts: list[tuple[int, int]]
    final: dict[int, tuple[TransferState, str]] = field(default_factory=dict)  # part index -> state


class TensorParallelBackend(TransferBackend):
    """Rank 0's TransferBackend for a PD worker of TP size > 1 (see the module doc). Built on rank
    0's own engine backend and the followers' channels; `register(pool)` (rank 0's pool) creates
    every follower's backend with the same `options`.

    `over_ranks` builds one for a group of ranks none of which is in this process (a DP attention
    group other than rank 0's, engine.dp_engine): every rank is a channel, and `register` takes the
    group's pool view (libkv.landing.RankGroupPool), used for checksums only."""

    def __init__(self, local: EngineBackend, followers: Sequence[RankChannel], options: dict,
                 pp_size: int = 1) -> None:
        if not followers:
            raise ValueError("a tensor-parallel backend needs follower ranks; "
                             "at TP 1 use the engine's backend")
        self._setup(local, local.name, type(local), followers, options, pp_size)
        self.timeout_s = local.timeout_s

    @classmethod
    def over_ranks(cls, name: str, ranks: Sequence[RankChannel], options: dict) -> TensorParallelBackend:
        """A backend over remote `ranks` only (see the class doc), for engine `name` with `options`."""
        if not ranks:
            raise ValueError("a rank group's backend needs at least one rank")
        self = cls.__new__(cls)
        self._setup(None, name, backend_class(name), ranks, options, 1)
        self.timeout_s = float(options.get("timeout_s", 30.0))
        return self

    def _setup(self, local: EngineBackend | None, name: str, engine: type[EngineBackend],
               followers: Sequence[RankChannel], options: dict, pp_size: int) -> None:
        self.local, self.name = local, name
        self.one_sided, self.moves_bytes = engine.one_sided, engine.moves_bytes
        self.followers = list(followers)
        self._options = options
        self.pp_size = pp_size  # the followers are the world's ranks: pp_size stages of TP ranks
        self._ranks: list[RankChannel] = []
        self._pool: KVPool | None = None
        self._endpoint: TransferEndpoint | None = None
        self._peers: dict[PeerId, _Peer] = {}
        self._by_endpoint: dict[TransferEndpoint, PeerId] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.bytes_per_rank = [0] * self.size

    @property
    def size(self) -> int:
        return len(self.followers) + (self.local is not None)

    def register(self, pool: KVPool) -> None:
        self._pool = pool
        if self.local is None:  # every rank is remote; `pool` is their view
            self._ranks = list(self.followers)
            self._endpoint = TransferEndpoint.of_ranks(
                [rank.call("create_backend", self.name, self._options) for rank in self._ranks])
            return
        self.local.register(pool, tp_rank=0, tp_size=self.size, pp_size=self.pp_size)
        rank_zero = InProcessRank(RankTransfer(pool, 0, self.size, self.pp_size, self.local))
        self._ranks = [rank_zero, *self.followers]
        endpoints = [self.local.endpoint(),
                     *(f.call("create_backend", self.name, self._options) for f in self.followers)]
        self._endpoint = TransferEndpoint.of_ranks(endpoints, self.pp_size)

    def endpoint(self) -> TransferEndpoint:
        if self._endpoint is None:
            raise RuntimeError(f"{self.name} backend: register(pool) first")
        return self._endpoint

    def close(self) -> None:
        if self.local is not None:
            self.local.close()  # each follower closes its own engine when rank 0 closes the group

    # ---- sender side -----------------------------------------------------------------------

    def connect(self, endpoint: TransferEndpoint) -> PeerId:
        with self._lock:
            known = self._by_endpoint.get(endpoint)
        if known is not None:
            return known
        links = [self._call(rank, "connect", endpoint) for rank in range(self.size)]
        peer_id = PeerId(f"tp{self.size}-peer-{next(self._ids)}")
        with self._lock:
            self._peers[peer_id] = _Peer(len(endpoint.ranks()), links)
            self._by_endpoint[endpoint] = peer_id
        return peer_id

    def disconnect(self, peer: PeerId) -> None:
        with self._lock:
            record = self._peers.pop(peer, None)
            for endpoint, known in list(self._by_endpoint.items()):
                if known == peer:
                    del self._by_endpoint[endpoint]
        if record is not None:
            for rank, rank_peer in enumerate(record.links):
                self._call(rank, "disconnect", rank_peer)

    def verify_grant(self, peer: PeerId, dst_pages: list[int], *, key: str, grant: bytes = b"") -> None:
        for rank, rank_peer in enumerate(self._peer(peer).links):
            self._call(rank, "verify_grant", rank_peer, list(dst_pages), key, grant)

    def write(self, peer: PeerId, src_pages: list[int], dst_pages: list[int], *,
              key: str = "", grant: bytes = b"") -> TransferHandle:
        write = _Write([])
        sent = [0] * self.size
        try:
            for rank, rank_peer in enumerate(self._peer(peer).links):
                transfer_id, sent[rank] = self._call(rank, "write", rank_peer, list(src_pages),
                                                     list(dst_pages), key, grant)
                write.parts.append((rank, transfer_id))
        except Exception:  # nothing of a write that could not be issued whole may go on
            self._abort_parts(write)
            raise
        with self._lock:
            for rank, nbytes in enumerate(sent):
                self.bytes_per_rank[rank] += nbytes
        return TransferHandle(next(self._ids), peer, key, len(src_pages), len(write.parts), sum(sent), write)

    def page_checksums_for(self, peer: PeerId, page_ids: list[int], *, key: str = "") -> list[int]:
        return sent_checksums(self._pool, page_ids, self._peer(peer).tp_size)  # type: ignore[arg-type]

    def poll(self, handle: TransferHandle) -> TransferState:
        write = self._write(handle)
        for index, (rank, transfer_id) in enumerate(write.parts):
            if index not in write.final:
                state, error = self._call(rank, "poll", transfer_id)
                if state.finished:
                    write.final[index] = (state, error)
        return TransferState.combined([write.final.get(index, (TransferState.PENDING, ""))[0]
                                       for index in range(len(write.parts))])

    async def _poll_on_loop(self, handle: TransferHandle) -> TransferState:
        # Followers answer over a socket (a blocking call): off the event loop.
        return await asyncio.to_thread(self.poll, handle)

    def abort(self, handle: TransferHandle) -> TransferState:
        return self._abort_parts(self._write(handle))

    def error(self, handle: TransferHandle) -> TransferError | None:
        write = self._write(handle)
        for index, (state, error) in sorted(write.final.items()):
            if state is not TransferState.DONE:
                return PeerUnreachable(f"tp rank {write.parts[index][0]}: {error or state.value}")
        return None

    def rank_bytes(self) -> list[int]:
        return list(self.bytes_per_rank)

    # ---- receiver side ---------------------------------------------------------------------

    def expect(self, key: str, dst_pages: list[int], grant: bytes = b"") -> None:
        try:
            for rank in self._ranks:
                rank.call("expect", key, list(dst_pages), grant)
        except BaseException:
            self.release_expectation(key)
            raise

    def release_expectation(self, key: str) -> None:
        for rank in self._ranks:
            rank.call("release_expectation", key)

    def expected_pages(self, key: str) -> frozenset[int]:
        return self._ranks[0].call("expected_pages", key)

    # ---- helpers ---------------------------------------------------------------------------

    def _call(self, rank: int, method: str, *args: object):
        """A rank's call, its failures as the transfer errors the PD services handle."""
        try:
            return self._ranks[rank].call(method, *args)
        except RankCallFailed as exc:
            if exc.type_name == "GrantRefused" and exc.detail is not None:
                raise GrantRefused(str(exc), exc.detail) from None  # type: ignore[arg-type]
            raise PeerUnreachable(str(exc)) from None

    def _peer(self, peer: PeerId) -> _Peer:
        with self._lock:
            record = self._peers.get(peer)
        if record is None:
            raise PeerUnreachable(f"unknown or disconnected peer {peer}")
        return record

    def _write(self, handle: TransferHandle) -> _Write:
        if not isinstance(handle.record, _Write):
            raise KeyError(f"transfer {handle.transfer_id} was not made by a write() of this backend")
        return handle.record

    def _abort_parts(self, write: _Write) -> TransferState:
        for index, (rank, transfer_id) in enumerate(write.parts):
            if index in write.final:
                continue
            try:
                state = self._call(rank, "abort", transfer_id)
            except TransferError:  # the rank is gone: its writes went with it
                state = TransferState.ABORTED
            write.final[index] = (state, "" if state is TransferState.DONE else "aborted")
        return TransferState.combined([state for state, _ in write.final.values()])
