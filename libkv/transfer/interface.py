"""TransferBackend: the one interface the PD services use to move KV pages, and the types it speaks.

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

Tensor parallelism: a worker of TP size N splits its KV heads over N rank processes (an MLA
model's ranks each hold the whole latent instead), and its endpoint lists its ranks' endpoints
(TransferEndpoint.of_ranks). Any backend connects to an endpoint of any TP size;
libkv.transfer.peers says how one rank writes to a peer's ranks, and
libkv.transfer.tensor_parallel is the backend of a worker with several ranks.

Thread safety: write, poll, wait, wait_blocking and abort may be called from any thread (the
PD services call them from an asyncio loop and from the engine thread). register, connect,
expect, release_expectation and close are safe too, but are meant for the owning service.
Raw engine addresses never leave a backend: the endpoint blob is opaque to everyone else.

Why the interface is apart from libkv.transfer.base (the machinery engines build on): the
tensor-parallel backend implements these methods by handing them to one engine backend per rank;
it has no engine, peer table or transfer table of its own and must not inherit them.
"""

from __future__ import annotations

import asyncio
import enum
import json
import time
from abc import ABC, abstractmethod
from base64 import b64decode, b64encode
from dataclasses import dataclass, field, replace
from typing import NewType

from libkv.layout import KVLayout
from libkv.pool import KVPool
from libkv.transfer.errors import TransferError
from libkv.transfer.head_map import whole_model

PeerId = NewType("PeerId", str)

# A TP worker's endpoint blob: this prefix, then the JSON list of its ranks' endpoints (each
# TransferEndpoint.to_json()); a pipeline-parallel worker's: the prefix, then {"pp_size": P,
# "ranks": that list}. The registry and the gRPC handshake carry it: never change it.
_RANKS_BLOB = b"pdserve-tp-endpoints:"
_POLL_FIRST_S = 0.0002
_POLL_MAX_S = 0.002


class TransferState(enum.Enum):
    """The state of a write (or of a grant read through an engine)."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def finished(self) -> bool:
        return self is not TransferState.PENDING

    @staticmethod
    def combined(states: list[TransferState]) -> TransferState:
        """The state of a write made of parts (one per rank or per engine connection): FAILED as
        soon as one part failed, else ABORTED if one was aborted, else PENDING while one is."""
        for state in (TransferState.FAILED, TransferState.ABORTED, TransferState.PENDING):
            if state in states:
                return state
        return TransferState.DONE


@dataclass(frozen=True)
class TransferEndpoint:
    """What a peer needs to write into this worker's pool.

    `blob` is opaque outside the backend that made it (addresses, agent metadata, session ids);
    the PD services carry it as protobuf `bytes` and the registry stores it untouched. A TP
    worker's endpoint has the whole model's layout and its ranks' endpoints in the blob.
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

    @classmethod
    def of_ranks(cls, ranks: list[TransferEndpoint], pp_size: int = 1) -> TransferEndpoint:
        """The endpoint of a worker whose KV heads are split over `ranks` (world rank order); a
        worker of one rank is its rank's endpoint, unchanged. With `pp_size` pipeline stages the
        ranks are pp_size stages of len(ranks) / pp_size TP ranks, each stage holding a block of
        the layers: the endpoint's layout is still the whole model's (all layers, all KV heads)."""
        first = ranks[0]
        if len(ranks) == 1:
            return first
        tp_size = len(ranks) // pp_size
        layout = whole_model(first.layout, tp_size)
        if pp_size > 1:
            layout = replace(layout, num_layers=sum(ranks[stage * tp_size].layout.num_layers
                                                    for stage in range(pp_size)))
            # The stage count travels only when there are stages, so a TP worker's blob reads as before.
            body: object = {"pp_size": pp_size, "ranks": [rank.to_json() for rank in ranks]}
        else:
            body = [rank.to_json() for rank in ranks]
        return cls(first.backend, layout, first.host, first.num_pages,
                   _RANKS_BLOB + json.dumps(body).encode())

    def ranks(self) -> list[TransferEndpoint]:
        """The endpoints of each rank of the worker behind this endpoint (itself at TP 1), in world
        rank order (stage by stage under pipeline parallelism)."""
        body = self._ranks_body()
        if body is None:
            return [self]
        texts = body["ranks"] if isinstance(body, dict) else body
        return [TransferEndpoint.from_json(text) for text in texts]

    def pp_size(self) -> int:
        """The pipeline stages of the worker behind this endpoint (1 without pipeline parallelism)."""
        body = self._ranks_body()
        return int(body["pp_size"]) if isinstance(body, dict) else 1

    def _ranks_body(self) -> list | dict | None:
        if not self.blob.startswith(_RANKS_BLOB):
            return None
        return json.loads(self.blob[len(_RANKS_BLOB):])


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
    record: object = field(default=None, repr=False, compare=False)


class TransferBackend(ABC):
    """Moves runs of KV pages from this worker's pool into a peer's pool (module doc: protocol).

    wait() and wait_blocking() are written once, here, in terms of poll() and error().
    """

    name: str
    timeout_s: float
    one_sided: bool = True
    moves_bytes: bool = True  # False only for `fake`: there is nothing to checksum

    # ---- lifecycle -------------------------------------------------------------------------

    @abstractmethod
    def register(self, pool: KVPool) -> None:
        """Register the pool's memory with the engine. Call once, before endpoint/connect/write."""

    @abstractmethod
    def endpoint(self) -> TransferEndpoint:
        """What a peer needs to connect to this worker (published through the registry)."""

    def endpoint_for(self, key: str) -> TransferEndpoint:
        """The endpoint a sender writes `key`'s pages through: endpoint(), except on a worker with
        DP attention groups (libkv.transfer.dp_groups), where it is the key's group's."""
        return self.endpoint()

    @abstractmethod
    def connect(self, endpoint: TransferEndpoint) -> PeerId:
        """Make a peer writable, whatever its TP size. Refuses a different backend or KV layout,
        and TP sizes whose KV heads cannot be mapped, naming both values (BackendMismatch,
        LayoutMismatch). Connecting to an endpoint already connected returns the same peer while
        it is usable; a peer declared dead is replaced."""

    @abstractmethod
    def disconnect(self, peer: PeerId) -> None:
        """Forget a peer (e.g. its lease expired). Its unfinished transfers are aborted."""

    @abstractmethod
    def close(self) -> None:
        """Abort what is in flight, then release the engine. The backend is unusable afterwards."""

    # ---- receiver side ---------------------------------------------------------------------

    @abstractmethod
    def expect(self, key: str, dst_pages: list[int], grant: bytes = b"") -> None:
        """Announce that the sender may write `dst_pages` under `key` with `grant`, and bind the
        pages to them in the grant table. Required before the sender verifies or writes.

        Calls for one key accumulate pages but must give the same grant; a page already bound
        to another key is refused (ValueError): a page belongs to one room at a time.
        """

    @abstractmethod
    def release_expectation(self, key: str) -> None:
        """Stop accepting data for `key`: its grant-table entries are zero when this returns, so
        a sender's verify_grant refuses them from now on. For two-sided backends, also returns
        once no receive into the key's pages is still posted (bounded by timeout_s); later data
        goes to scratch."""

    @abstractmethod
    def expected_pages(self, key: str) -> frozenset[int]:
        """The pages expect() bound to `key` and not released yet."""

    # ---- sender side -----------------------------------------------------------------------

    @abstractmethod
    def verify_grant(self, peer: PeerId, dst_pages: list[int], *, key: str, grant: bytes = b"") -> None:
        """Check that the peer bound every page of `dst_pages` to (key, grant); raise
        GrantRefused naming the first page that is not (and how many are not) otherwise.

        Sender side, blocking (call it from a thread): once per request after connect() and
        before the first write. One-sided backends read the peer's grant-table entries through
        the engine and endpoint the writes use; ucx asks the receiver. A read that fails or does
        not finish within timeout_s raises PeerUnreachable.
        """

    @abstractmethod
    def write(self, peer: PeerId, src_pages: list[int], dst_pages: list[int], *,
              key: str = "", grant: bytes = b"") -> TransferHandle:
        """Start writing local src_pages[i] into the peer's dst_pages[i]; returns at once.

        `key` names the receiver's expectation (the request's room) and `grant` its request;
        two-sided backends send both and their receiver refuses pages not bound to them
        (GrantRefused). One-sided engines cannot refuse a write: verify_grant() first.
        """

    @abstractmethod
    def page_checksums_for(self, peer: PeerId, page_ids: list[int], *, key: str = "") -> list[int]:
        """Checksums of local pages as the peer will compute them on arrival (libkv.landing). `key`:
        the room the pages are written for (a worker with DP attention groups holds them on the
        room's group; others ignore it)."""

    @abstractmethod
    def poll(self, handle: TransferHandle) -> TransferState:
        """Advance and report a transfer. Non-blocking; past the deadline it becomes FAILED."""

    @abstractmethod
    def abort(self, handle: TransferHandle) -> TransferState:
        """Stop a transfer. Returns only when no write of it can still land in the peer's memory
        (engine operations finished or cancelled), bounded by timeout_s; returns the final state
        (DONE if it had already completed)."""

    @abstractmethod
    def error(self, handle: TransferHandle) -> TransferError | None:
        """Why a finished transfer did not complete (None while pending or once done)."""

    @abstractmethod
    def rank_bytes(self) -> list[int]:
        """KV bytes written since start by each local tensor-parallel rank (one entry at TP 1)."""

    async def wait(self, handle: TransferHandle) -> None:
        """Return when the bytes are in the peer's memory; raise a TransferError otherwise."""
        delay = _POLL_FIRST_S
        while not (await self._poll_on_loop(handle)).finished:
            await asyncio.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)
        self._raise_if_failed(handle)

    def wait_blocking(self, handle: TransferHandle) -> None:
        """wait() for threads without an event loop (the engine thread, benchmarks)."""
        delay = _POLL_FIRST_S
        while not self.poll(handle).finished:
            self._pause(handle, delay)
            delay = min(delay * 2, _POLL_MAX_S)
        self._raise_if_failed(handle)

    async def _poll_on_loop(self, handle: TransferHandle) -> TransferState:
        """poll() from an event loop; a backend whose poll blocks runs it off the loop."""
        return self.poll(handle)

    def _pause(self, handle: TransferHandle, seconds: float) -> None:
        """Sleep between two polls of wait_blocking (a backend may wake up early on completion)."""
        time.sleep(seconds)

    def _raise_if_failed(self, handle: TransferHandle) -> None:
        error = self.error(handle)
        if error is not None:
            raise error
