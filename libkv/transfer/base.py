"""The one interface every KV transfer backend implements, and the types it speaks.

Lifecycle, per worker process (the receiver and the sender run the same steps):

    backend = create_backend("nixl", timeout_s=30)      # libkv.transfer.create_backend
    backend.register(pool)                               # once, before anything else
    ep = backend.endpoint()                              # publish: registry / handshake carries it
    peer = backend.connect(remote_ep)                    # sender side, once per remote worker
    backend.expect(room, dst_pages, grant)               # receiver side, before the sender writes
    backend.verify_grant(peer, dst_pages, key=room, grant=grant)   # sender, blocking, once
    handle = backend.write(peer, src_pages, dst_pages, key=room, grant=grant)   # non-blocking
    await backend.wait(handle)                           # or poll(handle) until not PENDING
    backend.abort(handle)                                # sender: stop; returns once nothing lands
    backend.release_expectation(room)                    # receiver: done with (or aborting) room
    backend.close()

Completion is known only to the sender: when wait() returns, the bytes are in the receiver's
memory. The receiver learns it over the control plane (the PD services use gRPC) and must not
read the pages before that message arrives.

Grants (libkv.transfer.grants): the receiver binds the pages it reserves for a room to
tag(room, grant), where `grant` is random per request and travels to the sender with the page
ids over the control plane. verify_grant() makes the sender prove, before its first write, that
every destination page is bound to the room and grant it was given; a forged, stale or buggy
request (pages of another room, free pages, pages released since, a wrong grant) fails with
GrantRefused and nothing is written. One-sided engines (mooncake, nixl) read the receiver's grant
table through the engine; the two-sided ucx receiver also checks the grant of every write.

Receiver-side rule for one-sided engines (mooncake, nixl): a write in flight cannot be recalled,
so after the receiver gives up on a key (release_expectation / abort), the destination pages may
be reused only after the sender confirms its abort() returned, or the sender is declared dead
(its process gone or its transfers timed out). For the two-sided `ucx` backend the receiver posts
receives itself: data for an unknown or released key lands in scratch memory, never in the pool.

Thread safety: write, poll, wait, wait_blocking and abort may be called from any thread (the
PD services call them from an asyncio loop and from the engine thread). register, connect,
expect, release_expectation and close are safe too, but are meant for the owning service.
Raw engine addresses never leave a backend: the endpoint blob is opaque to everyone else.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time
from abc import ABC, abstractmethod
from base64 import b64decode, b64encode
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, NewType

from libkv.layout import KVLayout
from libkv.pool import KVPool
from libkv.runs import ByteRun, PageRun, coalesce
from libkv.transfer.grant_reads import GrantReader, ReadFailed
from libkv.transfer.grants import GrantTable, Refusal, check_grant, grant_tag
from libkv.transfer.state import TransferState

log = logging.getLogger(__name__)

PeerId = NewType("PeerId", str)


class TransferError(RuntimeError):
    """A transfer did not complete; subclasses say why."""


class PeerUnreachable(TransferError):
    """The peer refused, dropped or never answered the connection or a write."""


class TransferTimeout(TransferError):
    """A write took longer than the backend's timeout_s; its peer is declared dead."""


class TransferAborted(TransferError):
    """The transfer was aborted by abort() (or the backend was closed under it)."""


class GrantRefused(TransferError):
    """The receiver did not reserve these pages for this room and grant (verify_grant, or a
    two-sided receiver refusing a write). Nothing was written; the message names the first
    refused page and how many were refused."""

    def __init__(self, message: str, refusal: Refusal) -> None:
        super().__init__(message)
        self.refusal = refusal


class BackendMismatch(ValueError):
    """Two workers use different transfer backends; the message names both."""


class EngineUnavailable(ImportError):
    """The transfer engine's Python package (or a system library it needs) is not installed."""


@dataclass(frozen=True)
class TransferEndpoint:
    """What a peer needs to write into this worker's pool.

    `blob` is opaque outside the backend that made it (addresses, agent metadata, session ids);
    the PD services carry it as protobuf `bytes` and the registry stores it untouched.
    """

    backend: str
    layout: KVLayout
    host: str
    num_pages: int
    blob: bytes

    def to_json(self) -> str:
        return json.dumps({"backend": self.backend, "layout": self.layout.to_dict(), "host": self.host,
                           "num_pages": self.num_pages, "blob": b64encode(self.blob).decode()})

    @classmethod
    def from_json(cls, text: str) -> TransferEndpoint:
        raw = json.loads(text)
        return cls(raw["backend"], KVLayout.from_dict(raw["layout"]), raw["host"], int(raw["num_pages"]),
                   b64decode(raw["blob"]))


@dataclass(frozen=True)
class TransferHandle:
    """Names one write. Opaque: pass it back to poll / wait / abort of the backend that made it.

    The handle keeps the backend's record of the write alive, so a finished write costs the
    backend nothing once its handles are dropped (no forget() needed).
    """

    transfer_id: int
    peer: PeerId
    key: str
    num_pages: int
    num_runs: int
    nbytes: int
    record: Transfer | None = field(default=None, repr=False, compare=False)


@dataclass(eq=False)
class Transfer:
    """A backend's record of one write. `engine` holds whatever the engine needs (request ids,
    xfer handles); only the backend that created the record looks inside it."""

    handle: TransferHandle | None  # set right after the handle is made (they refer to each other)
    runs: list[PageRun] | list[ByteRun]
    deadline: float
    owner: int = 0  # id() of the backend that made it
    state: TransferState = TransferState.PENDING
    error: TransferError | None = None
    engine: Any = None
    grant: bytes = field(default=b"", repr=False)  # carried by two-sided backends' write headers
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Set by backends whose engine calls back on completion, so blocking waiters wake at once
    # instead of at their next poll.
    wakeup: threading.Event = field(default_factory=threading.Event)


@dataclass
class Peer:
    """A connected remote worker. `engine` is backend-private (session id, agent name, endpoint)."""

    peer_id: PeerId
    endpoint: TransferEndpoint
    engine: Any = None
    dead: str = ""  # why the peer was declared dead; empty while it is usable


_POLL_FIRST_S = 0.0002
_POLL_MAX_S = 0.002


class TransferBackend(ABC):
    """Moves runs of KV pages from this worker's pool into a peer's pool.

    Subclasses implement the `_engine_*` hooks; this class owns validation, page-run coalescing,
    the table of transfers, timeouts, the waiting loops and the thread-safety of all of it.
    """

    name: ClassVar[str]
    one_sided: ClassVar[bool] = True
    moves_bytes: ClassVar[bool] = True  # False only for `fake`: there is nothing to checksum

    def __init__(self, *, timeout_s: float = 30.0, host: str = "127.0.0.1") -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self.host = host
        self.pool: KVPool | None = None
        self._lock = threading.RLock()
        self._transfers: dict[int, Transfer] = {}  # unfinished writes, for close() / disconnect()
        self._peers: dict[PeerId, Peer] = {}
        self._by_endpoint: dict[TransferEndpoint, PeerId] = {}
        self._expected: dict[str, frozenset[int]] = {}
        self._tags: dict[str, bytes] = {}  # key -> tag(key, grant) of its expectation
        self.grants: GrantTable | None = None  # set by register(); see libkv.transfer.grants
        self._ids = itertools.count(1)
        self._closed = False

    # ---- lifecycle -------------------------------------------------------------------------

    def register(self, pool: KVPool) -> None:
        """Register the pool's memory with the engine. Call once, before endpoint/connect/write."""
        with self._lock:
            if self.pool is not None:
                raise RuntimeError(f"{self.name} backend already has a registered pool")
            if pool.device.type != "cpu":
                raise ValueError(f"{self.name} backend here supports host memory only, got {pool.device}")
            self.grants = GrantTable(pool.num_pages)  # the engine registers it next to the pool
            self._engine_register(pool)
            self.pool = pool

    def endpoint(self) -> TransferEndpoint:
        pool = self._require_pool()
        return TransferEndpoint(self.name, pool.layout, self.host, pool.num_pages, self._engine_blob())

    def connect(self, endpoint: TransferEndpoint, *, heads_may_differ: bool = False) -> PeerId:
        """Make a peer writable. Refuses a different backend or KV layout, naming both values
        (but for the KV head count with `heads_may_differ`: a tensor-parallel peer that splits the
        heads another way, written with write_regions; engine.tp checked the whole model's layout).

        Connecting to an endpoint already connected returns the same peer while it is usable (a
        prefill connects once per request: without this, every request would repeat the engine
        handshake and leave one more peer behind); a peer declared dead is replaced.
        """
        pool = self._require_pool()
        if endpoint.backend != self.name:
            raise BackendMismatch(f"transfer backend mismatch (local vs remote): {self.name} vs "
                                  f"{endpoint.backend}")
        mine = replace(pool.layout, num_kv_heads=endpoint.layout.num_kv_heads) if heads_may_differ else pool.layout
        mine.check_compatible(endpoint.layout, mine="local", theirs=f"remote {endpoint.host}")
        existing = self._live_peer_for(endpoint)
        if existing is not None:
            return existing
        peer_id = PeerId(f"{self.name}-peer-{next(self._ids)}")
        peer = Peer(peer_id, endpoint)
        # Not under the backend lock: an engine handshake may wait on the engine's own thread,
        # which takes the lock to serve incoming transfers.
        peer.engine = self._engine_connect(endpoint)
        with self._lock:
            raced = self._by_endpoint.get(endpoint)
            if raced is not None and raced in self._peers and not self._peers[raced].dead:
                winner = raced  # another thread connected the same endpoint meanwhile
            else:
                self._peers[peer_id] = peer
                self._by_endpoint[endpoint] = winner = peer_id
        if winner != peer_id:
            self._engine_disconnect(peer)
        return winner

    def _live_peer_for(self, endpoint: TransferEndpoint) -> PeerId | None:
        """The usable peer already connected to `endpoint`, if any; forgets dead peers on the way."""
        with self._lock:
            dead = [p for p in self._peers.values() if p.dead]
            peer_id = self._by_endpoint.get(endpoint)
            usable = peer_id is not None and peer_id in self._peers and not self._peers[peer_id].dead
        for peer in dead:
            self.disconnect(peer.peer_id)
        return peer_id if usable else None

    def disconnect(self, peer_id: PeerId) -> None:
        """Forget a peer (e.g. its lease expired). Its unfinished transfers are aborted."""
        for record in [t for t in list(self._transfers.values()) if t.handle.peer == peer_id]:
            self.abort(record.handle)
        with self._lock:
            peer = self._peers.pop(peer_id, None)
            if peer is not None and self._by_endpoint.get(peer.endpoint) == peer_id:
                del self._by_endpoint[peer.endpoint]
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
            peers = list(self._peers.values())
            self._peers.clear()
            self._by_endpoint.clear()
        for peer in peers:
            try:
                self._engine_disconnect(peer)
            except Exception:  # closing must not fail because one peer is already gone
                log.exception("%s: disconnecting %s failed", self.name, peer.peer_id)
        self._engine_close()

    # ---- receiver side ---------------------------------------------------------------------

    def expect(self, key: str, dst_pages: list[int], grant: bytes = b"") -> None:
        """Announce that the sender may write `dst_pages` under `key` with `grant`, and bind the
        pages to them in the grant table. Required before the sender verifies or writes.

        Calls for one key accumulate pages but must give the same grant; a page already bound
        to another key is refused (ValueError): a page belongs to one room at a time.
        """
        pool = self._require_pool()
        bad = [p for p in dst_pages if not 0 <= p < pool.num_pages]
        if bad:
            raise IndexError(f"expect({key!r}): pages {bad[:8]} outside pool of {pool.num_pages} pages")
        tag = grant_tag(key, grant)
        new = sorted(set(dst_pages))
        with self._lock:
            known = self._tags.get(key)
            if known is not None and known != tag:
                raise ValueError(f"expect({key!r}): the key is already expected with another grant; "
                                 "release_expectation() first")
            owners = self.grants.owners(new)
            taken = [p for p, owner in zip(new, owners, strict=True) if owner.any() and owner.tobytes() != tag]
            if taken:
                holders = sorted({k for k, pages in self._expected.items() if taken[0] in pages})
                raise ValueError(f"expect({key!r}): page {taken[0]} (and {len(taken) - 1} more) already "
                                 f"expected by {', '.join(map(repr, holders)) or 'another key'}")
            self.grants.bind(new, tag)
            pages = frozenset(new) | self._expected.get(key, frozenset())
            self._expected[key] = pages
            self._tags[key] = tag
            self._engine_expect(key, pages)

    def release_expectation(self, key: str) -> None:
        """Stop accepting data for `key`: its grant-table entries are zero when this returns, so
        a sender's verify_grant refuses them from now on. For two-sided backends, also returns
        once no receive into the key's pages is still posted (bounded by timeout_s); later data
        goes to scratch."""
        with self._lock:
            pages = self._expected.pop(key, None)
            self._tags.pop(key, None)
            if pages is not None:
                self.grants.clear(sorted(pages))
        if pages is not None:
            self._engine_release(key, pages)

    def expected_pages(self, key: str) -> frozenset[int]:
        with self._lock:
            return self._expected.get(key, frozenset())

    # ---- sender side -----------------------------------------------------------------------

    def verify_grant(self, peer: PeerId, dst_pages: list[int], *, key: str, grant: bytes = b"") -> None:
        """Check that the peer bound every page of `dst_pages` to (key, grant); raise
        GrantRefused naming the first page that is not (and how many are not) otherwise.

        Sender side, blocking (call it from a thread): once per request after connect() and
        before the first write. One-sided backends read the peer's grant-table entries through
        the engine and endpoint the writes use (one engine read per few thousand pages, more
        only for widely scattered pages) and compare them here; ucx asks the receiver. A read
        that fails or does not finish within timeout_s raises PeerUnreachable.
        """
        tag = grant_tag(key, grant)
        target = self._usable_peer(peer)
        _check_pages("destination", dst_pages, target.endpoint.num_pages)
        if not dst_pages:
            return
        try:
            refusal = self._engine_verify_grant(target, list(dst_pages), key, check_grant(grant), tag)
        except PeerUnreachable as exc:
            self._declare_dead(peer, exc)
            raise
        if refusal is not None:
            raise GrantRefused(
                f"{self.name} peer {peer} ({target.endpoint.host}) did not reserve page {refusal.first_page} "
                f"for key {key!r} and this grant ({refusal.count} of {refusal.total} pages refused)", refusal)

    def write(self, peer: PeerId, src_pages: list[int], dst_pages: list[int], *,
              key: str = "", grant: bytes = b"") -> TransferHandle:
        """Start writing local src_pages[i] into the peer's dst_pages[i]; returns at once.

        Consecutive pages on both sides coalesce into one run, and each run is one engine write
        (the pool is page-major, so a run is one contiguous region on each side). `key` names
        the receiver's expectation (the request's room) and `grant` its request; two-sided
        backends send both and their receiver refuses pages not bound to them (GrantRefused).
        One-sided engines cannot refuse a write: verify_grant() first.
        """
        pool = self._require_pool()
        grant = check_grant(grant)
        runs = coalesce(list(src_pages), list(dst_pages))
        target = self._usable_peer(peer)
        _check_pages("source", src_pages, pool.num_pages)
        _check_pages("destination", dst_pages, target.endpoint.num_pages)
        page_nbytes = pool.layout.page_nbytes
        return self._start_write(target, peer, key, grant, runs, len(src_pages), len(src_pages) * page_nbytes)

    def _start_write(self, target, peer: PeerId, key: str, grant: bytes, pieces: list, num_pages: int,
               nbytes: int) -> TransferHandle:
        """Record a transfer of `pieces` (page runs or byte regions) and hand it to the engine."""
        record = Transfer(None, pieces, time.monotonic() + self.timeout_s, owner=id(self), grant=grant)
        handle = TransferHandle(next(self._ids), peer, key, num_pages, len(pieces), nbytes, record)
        record.handle = handle
        if not pieces:
            record.state = TransferState.DONE
            return handle
        with self._lock:
            self._transfers[handle.transfer_id] = record
        try:
            record.engine = self._engine_write(target, record)
        except TransferError as exc:
            if isinstance(exc, PeerUnreachable):
                self._declare_dead(peer, exc)
            self._finish(record, TransferState.FAILED, exc)
        except Exception as exc:  # an engine refusing a request is a failed transfer, not a crash
            error = PeerUnreachable(f"{self.name} write failed: {exc}")
            self._declare_dead(peer, error)
            self._finish(record, TransferState.FAILED, error)
        return handle

    # Engines that write any list of byte regions (one-sided RMA); UCX's protocol moves pages.
    writes_regions: ClassVar[bool] = False

    def write_regions(self, peer: PeerId, regions: list[ByteRun], src_pages: list[int], dst_pages: list[int], *,
                      key: str = "", grant: bytes = b"") -> TransferHandle:
        """Start writing byte regions of the local pages `src_pages` into the peer's `dst_pages`
        (a peer whose pages hold other KV heads: engine.tp); returns at once, like write().
        The caller made the regions from those pages; every region must lie inside them."""
        if not self.writes_regions:
            raise TransferError(f"{self.name} backend writes whole pages only")
        pool = self._require_pool()
        grant = check_grant(grant)
        target = self._usable_peer(peer)
        _check_pages("source", src_pages, pool.num_pages)
        _check_pages("destination", dst_pages, target.endpoint.num_pages)
        _check_regions(regions, src_pages, pool.layout.page_nbytes, dst_pages, target.endpoint.layout.page_nbytes)
        return self._start_write(target, peer, key, grant, list(regions), len(src_pages), sum(r.nbytes for r in regions))

    def page_checksums_for(self, peer: PeerId, page_ids: list[int]) -> list[int]:
        """Checksums of local pages as the peer will compute them on arrival (landing check)."""
        return self._require_pool().page_checksums(page_ids)

    def poll(self, handle: TransferHandle) -> TransferState:
        """Advance and report a transfer. Non-blocking; past the deadline it becomes FAILED."""
        record = self._record(handle)
        if record.state.finished:
            return record.state
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

    async def wait(self, handle: TransferHandle) -> None:
        """Return when the bytes are in the peer's memory; raise a TransferError otherwise."""
        delay = _POLL_FIRST_S
        while not self.poll(handle).finished:
            await asyncio.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)
        self._raise_if_failed(handle)

    def wait_blocking(self, handle: TransferHandle) -> None:
        """wait() for threads without an event loop (the engine thread, benchmarks)."""
        record = self._record(handle)
        delay = _POLL_FIRST_S
        while not self.poll(handle).finished:
            record.wakeup.wait(delay)
            delay = min(delay * 2, _POLL_MAX_S)
        self._raise_if_failed(handle)

    def abort(self, handle: TransferHandle) -> TransferState:
        """Stop a transfer. Returns only when no write of it can still land in the peer's memory
        (engine operations finished or cancelled), bounded by timeout_s; returns the final state
        (DONE if it had already completed)."""
        record = self._record(handle)
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

    def error(self, handle: TransferHandle) -> TransferError | None:
        return self._record(handle).error

    # ---- helpers for subclasses ------------------------------------------------------------

    def _require_pool(self) -> KVPool:
        if self.pool is None:
            raise RuntimeError(f"{self.name} backend: register(pool) first")
        return self.pool

    def _usable_peer(self, peer: PeerId) -> Peer:
        self._require_pool()
        with self._lock:
            if self._closed:
                raise TransferAborted(f"{self.name} backend is closed")
            target = self._peers.get(peer)
            if target is None:
                raise PeerUnreachable(f"unknown peer {peer!r}; connect() first")
            if target.dead:
                raise PeerUnreachable(f"peer {peer} ({target.endpoint.host}) is dead: {target.dead}")
        return target

    def _record(self, handle: TransferHandle) -> Transfer:
        if handle.record is None or handle.record.owner != id(self):
            raise KeyError(f"transfer {handle.transfer_id} was not made by a write() of this backend")
        return handle.record

    def _raise_if_failed(self, handle: TransferHandle) -> None:
        record = self._record(handle)
        if record.state is not TransferState.DONE:
            raise record.error or TransferError(f"transfer {handle.transfer_id} ended {record.state.value}")

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
        an unreachable peer declare the peer dead (see _declare_dead)."""
        # A timed-out peer is presumed dead: give in-flight operations a short grace, not another
        # full timeout.
        grace = 1.0 if timed_out else min(self.timeout_s, 5.0)
        try:
            self._engine_cancel(record, time.monotonic() + grace)
        except Exception:
            log.exception("%s: cancelling failed transfer %d", self.name, record.handle.transfer_id)
        if timed_out or isinstance(error, PeerUnreachable):
            self._declare_dead(record.handle.peer, error)
        self._finish(record, TransferState.FAILED, error)

    def _declare_dead(self, peer_id: PeerId, error: TransferError) -> None:
        """Stop using this connection: later writes to it fail at once, and the next connect() to
        the same endpoint makes a fresh one. Why a fresh one: an engine that saw its peer vanish
        (a network cut, a frozen process) may keep the connection marked broken after the peer is
        back (NIXL answers every later request with NIXL_ERR_REMOTE_DISCONNECT), so reusing it
        would fail every request of that (prefill, decode) pair for good."""
        with self._lock:
            peer = self._peers.get(peer_id)
            if peer is not None and not peer.dead:
                peer.dead = str(error)
                log.warning("%s: %s (%s) declared dead, next use reconnects: %s", self.name, peer_id,
                            peer.endpoint.host, error)

    def _run_bytes(self, run: PageRun | ByteRun) -> tuple[int, int, int]:
        """(source byte offset, destination byte offset, byte length) of a run; both pools have
        the same page size because connect() checked the layouts (a ByteRun carries its own)."""
        if isinstance(run, ByteRun):
            return run.src, run.dst, run.nbytes
        page_nbytes = self._require_pool().layout.page_nbytes
        return run.src_page * page_nbytes, run.dst_page * page_nbytes, run.length * page_nbytes

    # ---- engine hooks ----------------------------------------------------------------------

    @abstractmethod
    def _engine_register(self, pool: KVPool) -> None: ...

    @abstractmethod
    def _engine_blob(self) -> bytes: ...

    @abstractmethod
    def _engine_connect(self, endpoint: TransferEndpoint) -> Any:
        """Return backend-private peer state; raise PeerUnreachable if the peer cannot be used."""

    def _engine_disconnect(self, peer: Peer) -> None:  # noqa: B027 - optional hook
        pass

    @abstractmethod
    def _engine_write(self, peer: Peer, record: Transfer) -> Any:
        """Start one engine write per run of record.runs; return backend-private state."""

    @abstractmethod
    def _engine_progress(self, record: Transfer) -> TransferState:
        """PENDING, DONE or FAILED (set record.error to say why); never blocks."""

    @abstractmethod
    def _engine_cancel(self, record: Transfer, deadline: float) -> None:
        """Make sure no byte of this transfer can still land remotely, trying until `deadline`."""

    def _engine_release_transfer(self, record: Transfer) -> None:  # noqa: B027 - optional hook
        pass

    def _engine_verify_grant(self, peer: Peer, pages: list[int], key: str, grant: bytes,
                             tag: bytes) -> Refusal | None:
        """None if every page's entry on the peer equals `tag`, else the refusal. The default
        reads the entries through the engine (libkv.transfer.grant_reads) with the read hooks
        below, which one-sided backends implement."""
        reader = GrantReader(self.grants, lambda reads: self._engine_read_grants(peer, reads),
                             self._engine_read_progress, self._engine_read_release, self.timeout_s)
        try:
            return reader.verify(pages, tag)
        except TransferError:
            raise
        except Exception as exc:  # ReadFailed, or the engine refusing the request
            why = str(exc) if isinstance(exc, ReadFailed) else f"the engine refused the read: {exc}"
            raise PeerUnreachable(f"{self.name}: reading the grants of {peer.peer_id} "
                                  f"({peer.endpoint.host}) failed: {why}") from exc

    def _engine_read_grants(self, peer: Peer, reads: list[tuple[int, int, int]]) -> Any:
        """Start reading, for each (local address, first page, count), the peer's grant-table
        entries of pages first .. first+count-1 into local registered memory; return
        backend-private state for _engine_read_progress. One engine operation if possible."""
        raise NotImplementedError(f"{self.name} cannot read a peer's grant table")

    def _engine_read_progress(self, op: Any) -> TransferState:
        """PENDING, DONE or FAILED for a read from _engine_read_grants; never blocks."""
        raise NotImplementedError(f"{self.name} cannot read a peer's grant table")

    def _engine_read_release(self, op: Any) -> None:  # noqa: B027 - optional hook
        """Free the engine's state of a finished read (called once, after DONE or FAILED)."""

    def _engine_expect(self, key: str, pages: frozenset[int]) -> None:  # noqa: B027 - optional hook
        pass

    def _engine_release(self, key: str, pages: frozenset[int]) -> None:  # noqa: B027 - optional hook
        pass

    def _engine_close(self) -> None:  # noqa: B027 - optional hook
        pass


def _check_regions(regions: list[ByteRun], src_pages: list[int], src_page_nbytes: int, dst_pages: list[int],
                   dst_page_nbytes: int) -> None:
    """Every region inside one of the named pages on both sides: a caller bug cannot write elsewhere."""
    src_set, dst_set = set(src_pages), set(dst_pages)
    for region in regions:
        src_page, dst_page = region.src // src_page_nbytes, region.dst // dst_page_nbytes
        if (region.nbytes <= 0 or src_page not in src_set or dst_page not in dst_set
                or (region.src + region.nbytes - 1) // src_page_nbytes != src_page
                or (region.dst + region.nbytes - 1) // dst_page_nbytes != dst_page):
            raise ValueError(f"byte region {region} is not inside the pages it writes")


def _check_pages(side: str, pages: list[int], num_pages: int) -> None:
    bad = [p for p in pages if not 0 <= p < num_pages]
    if bad:
        raise IndexError(f"{side} pages {bad[:8]} outside a pool of {num_pages} pages")
    if side == "destination" and len(set(pages)) != len(pages):
        raise ValueError("destination pages repeat: each page may be written once per transfer")
