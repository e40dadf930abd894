"""The peers of one EngineBackend: its engine connections, and how a peer of any TP size maps onto them.

A backend is registered on one pool: the worker's, or one rank's of a TP worker (`tp_rank` of
`tp_size`, given by libkv.transfer.tensor_parallel; under pipeline parallelism the world rank of
tp * pp ranks, and only a peer of the same tp and pp is accepted: rank r writes whole pages, its
stage's layers, to rank r; `check_stages`). connect() reads the peer's rank endpoints
(TransferEndpoint.ranks):
  same TP size   one engine connection, to the peer's rank of the same index: whole pages, every
                 run of consecutive pages one engine write;
  another size   one engine connection per peer rank this rank shares KV heads with
                 (libkv.transfer.head_map), grouped under one PeerId (a `Route`); a write is then
                 one engine write of byte regions (those heads' pieces of each page) per
                 connection. Only engines that write byte regions (`writes_regions`) can; the
                 others are refused in connect(), naming both --tp-size values.
  MLA, another   every rank holds the whole latent page: one engine connection per peer rank
  size           this rank is the one writer of (head_map.latent_receivers), whole pages as for
                 the same size, any engine; a rank that writes to no peer rank has no connection
                 and its writes are done at once, with nothing moved.
So a TP-1 worker pairs with a TP-N worker in both directions, and a TP-N worker only fans its
calls out over its own ranks. `links_to_other_size` plans the connections of the last two cases.

PeerTable keeps the connections and routes; EngineBackend makes and ends them through its engine.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping, ValuesView
from dataclasses import dataclass, replace
from typing import TypeAlias

from libkv.layout import KVLayout, LayoutMismatch
from libkv.transfer.errors import BackendMismatch, PeerUnreachable, TransferError
from libkv.transfer.head_map import HeadSlice, latent_receivers, sender_slices, whole_model
from libkv.transfer.hooks import Peer
from libkv.transfer.interface import PeerId, TransferEndpoint

log = logging.getLogger(__name__)

# One engine connection of a write, with the heads it carries (None: whole pages).
Link: TypeAlias = tuple[HeadSlice | None, PeerId]


@dataclass
class Route:
    """A peer of another TP size: the engine connections a write to it fans out to, one per
    remote rank that shares KV heads with this rank, with the heads each one carries (None: whole
    MLA latent pages, to the remote ranks this rank writes; none at all for a rank that writes none)."""

    endpoint: TransferEndpoint
    tp_size: int
    links: list[Link]


@dataclass(frozen=True)
class RankLink:
    """A connection to make for a peer of another TP size: to the peer rank behind `endpoint`,
    whose pool must have `layout`, carrying `cut`'s heads (None: whole pages)."""

    cut: HeadSlice | None
    endpoint: TransferEndpoint
    layout: KVLayout


def check_stages(pp_size: int, tp_size: int, their_pp: int, their_ranks: int) -> None:
    """Refuse a peer split into other pipeline stages, or into another TP size under pipeline
    parallelism: a rank's pages hold only its stage's layers, so only rank r to rank r of the
    same (tp, pp) layout lines up (no layer remapping here). `tp_size` and `their_ranks` count
    world ranks (tp * pp)."""
    if their_pp != pp_size:
        raise LayoutMismatch(
            f"pipeline stages differ: --pp-size {pp_size} (prefill) vs --pp-size {their_pp} (decode); "
            "each rank's KV pages hold its stage's layers, so only workers of equal --pp-size exchange KV")
    if pp_size > 1 and their_ranks != tp_size:
        raise LayoutMismatch(
            f"--tp-size {tp_size // pp_size} (prefill) vs --tp-size {their_ranks // their_pp} (decode) "
            f"at --pp-size {pp_size}: pipeline-parallel workers exchange KV only at equal --tp-size")


def links_to_other_size(engine: str, writes_regions: bool, mine: KVLayout, tp_rank: int, tp_size: int,
                        ranks: list[TransferEndpoint]) -> list[RankLink]:
    """The connections rank `tp_rank` of `tp_size` (pages of `mine`) makes to a peer whose
    `ranks` are of another number (module doc), after refusing layouts or sizes that do not map,
    and an engine that cannot write byte regions where heads are split."""
    if mine.is_mla or ranks[0].layout.is_mla:
        whole_model(mine, tp_size).check_compatible(
            whole_model(ranks[0].layout, len(ranks)), mine="prefill", theirs="decode")
        return [RankLink(None, ranks[rank], mine) for rank in latent_receivers(tp_size, len(ranks), tp_rank)]
    cuts = sender_slices(mine, tp_rank, tp_size, ranks[0].layout, len(ranks))
    if not writes_regions:
        raise BackendMismatch(f"{engine} moves whole pages only: KV between --tp-size {tp_size} "
                              f"and --tp-size {len(ranks)} needs mooncake or nixl")
    theirs = replace(mine, num_kv_heads=ranks[0].layout.num_kv_heads)  # per rank of theirs
    return [RankLink(cut, ranks[cut.dst_rank], theirs) for cut in cuts]


class PeerTable(Mapping[PeerId, Peer]):
    """The engine connections of one backend (a Mapping PeerId -> Peer), by endpoint too, and the
    routes over several of them (peers of another TP size). It makes no engine call: the backend
    connects and disconnects, outside the lock, since an engine handshake may wait on the engine's
    own thread, which takes the lock to serve incoming transfers. Every method takes the backend's
    lock, shared here; ids come from the backend's counter."""

    def __init__(self, engine: str, lock: threading.RLock, ids: Iterator[int]) -> None:
        self.engine = engine
        self._lock = lock
        self._ids = ids
        self._peers: dict[PeerId, Peer] = {}
        self._by_endpoint: dict[TransferEndpoint, PeerId] = {}
        self._routes: dict[PeerId, Route] = {}
        self._route_by_endpoint: dict[TransferEndpoint, PeerId] = {}

    def __getitem__(self, peer_id: PeerId) -> Peer:
        with self._lock:
            return self._peers[peer_id]

    def __iter__(self) -> Iterator[PeerId]:
        with self._lock:
            return iter(list(self._peers))

    def __len__(self) -> int:
        return len(self._peers)

    def values(self) -> ValuesView[Peer]:
        """The connections now (a snapshot: engine hooks read it while others connect)."""
        with self._lock:
            return dict(self._peers).values()

    def new_id(self) -> PeerId:
        return PeerId(f"{self.engine}-peer-{next(self._ids)}")

    # ---- connections ---------------------------------------------------------------------------

    def live_for(self, endpoint: TransferEndpoint) -> tuple[PeerId | None, list[Peer]]:
        """The usable connection to `endpoint` (None: none), and every connection declared dead
        (for the caller to disconnect)."""
        with self._lock:
            dead = [p for p in self._peers.values() if p.dead]
            peer_id = self._by_endpoint.get(endpoint)
            usable = peer_id is not None and peer_id in self._peers and not self._peers[peer_id].dead
        return (peer_id if usable else None), dead

    def add(self, peer: Peer) -> PeerId:
        """Keep `peer` as the connection to its endpoint and return its id; or, when another
        thread connected the same endpoint meanwhile, keep that one and return its id (the caller
        then disconnects `peer`)."""
        with self._lock:
            raced = self._by_endpoint.get(peer.endpoint)
            if raced is not None and raced in self._peers and not self._peers[raced].dead:
                return raced
            self._peers[peer.peer_id] = peer
            self._by_endpoint[peer.endpoint] = peer.peer_id
            return peer.peer_id

    def remove(self, peer_id: PeerId) -> Peer | None:
        with self._lock:
            peer = self._peers.pop(peer_id, None)
            if peer is not None and self._by_endpoint.get(peer.endpoint) == peer_id:
                del self._by_endpoint[peer.endpoint]
        return peer

    def usable(self, peer_id: PeerId) -> Peer:
        """The connection `peer_id`; PeerUnreachable if it is unknown or declared dead."""
        with self._lock:
            target = self._peers.get(peer_id)
            if target is None:
                raise PeerUnreachable(f"unknown peer {peer_id!r}; connect() first")
            if target.dead:
                raise PeerUnreachable(f"peer {peer_id} ({target.endpoint.host}) is dead: {target.dead}")
        return target

    def declare_dead(self, peer_id: PeerId, error: TransferError) -> None:
        """Stop using this connection: later writes to it fail at once, and the next connect() to
        the same endpoint makes a fresh one. Why a fresh one: an engine that saw its peer vanish
        (a network cut, a frozen process) may keep the connection marked broken after the peer is
        back (NIXL answers every later request with NIXL_ERR_REMOTE_DISCONNECT), so reusing it
        would fail every request of that (prefill, decode) pair for good."""
        with self._lock:
            peer = self._peers.get(peer_id)
            if peer is not None and not peer.dead:
                peer.dead = str(error)
                log.warning("%s: %s (%s) declared dead, next use reconnects: %s", self.engine, peer_id,
                            peer.endpoint.host, error)

    # ---- routes ----------------------------------------------------------------------------------

    def route(self, endpoint: TransferEndpoint, tp_size: int, links: list[Link]) -> PeerId:
        """The PeerId of a peer of another TP size; a new one when one of its connections was
        replaced (the old id then names nothing: its dead connection is gone already)."""
        with self._lock:
            known = self._route_by_endpoint.get(endpoint)
            if known is not None:
                route = self._routes.get(known)
                if route is not None and route.links == links:
                    return known
                self._routes.pop(known, None)
            peer_id = self.new_id()
            self._routes[peer_id] = Route(endpoint, tp_size, links)
            self._route_by_endpoint[endpoint] = peer_id
        return peer_id

    def route_of(self, peer_id: PeerId) -> Route | None:
        with self._lock:
            return self._routes.get(peer_id)

    def remove_route(self, peer_id: PeerId) -> Route | None:
        with self._lock:
            route = self._routes.pop(peer_id, None)
            if route is not None and self._route_by_endpoint.get(route.endpoint) == peer_id:
                del self._route_by_endpoint[route.endpoint]
        return route

    def links(self, peer_id: PeerId) -> list[Link]:
        """The connections a write to `peer_id` goes through: its route's, or itself."""
        route = self.route_of(peer_id)
        return [(None, peer_id)] if route is None else list(route.links)

    def clear(self) -> list[Peer]:
        """Forget every connection and route; returns the connections (for the caller to end)."""
        with self._lock:
            peers = list(self._peers.values())
            self._peers.clear()
            self._by_endpoint.clear()
            self._routes.clear()
            self._route_by_endpoint.clear()
        return peers
