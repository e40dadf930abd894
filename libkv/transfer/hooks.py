"""What a transfer engine implements to become a backend: the `_engine_*` hooks, and the records
of peers and writes that libkv.transfer.base hands them.

The base class owns everything around the engine (validation, the tables, timeouts, dead peers,
thread safety); a hook does one engine operation and never waits longer than it is told.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from libkv.pool import ByteRun, KVPool, PageRun
from libkv.transfer.errors import PeerUnreachable, TransferError
from libkv.transfer.grants import GrantReader, GrantTable, ReadFailed, Refusal
from libkv.transfer.interface import PeerId, TransferEndpoint, TransferHandle, TransferState


@dataclass
class Peer:
    """One engine connection, to one remote pool (a worker's, or one rank's of a TP worker).
    `engine` is backend-private (session id, agent name, endpoint)."""

    peer_id: PeerId
    endpoint: TransferEndpoint
    engine: Any = None
    dead: str = ""  # why the peer was declared dead; empty while it is usable


@dataclass(eq=False)
class Transfer:
    """A backend's record of one write. `engine` holds whatever the engine needs (request ids,
    xfer handles); only the backend that created the record looks inside it.

    A write to a peer of another TP size goes to several remote ranks: its record then only
    groups `parts`, one record per engine connection, each written through the hooks."""

    # Set by EngineBackend.write right after the record is made: the two refer to each other.
    handle: TransferHandle = field(init=False)
    runs: list[PageRun] | list[ByteRun]
    deadline: float
    owner: int = 0  # id() of the backend that made it
    state: TransferState = TransferState.PENDING
    error: TransferError | None = None
    engine: Any = None
    grant: bytes = field(default=b"", repr=False)  # carried by two-sided backends' write headers
    parts: list[Transfer] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Set by backends whose engine calls back on completion, so blocking waiters wake at once
    # instead of at their next poll.
    wakeup: threading.Event = field(default_factory=threading.Event)


class EngineHooks(ABC):
    """The hooks of one engine. Required: register, blob, connect, write, progress, cancel; the
    rest have defaults. One-sided engines implement the grant-read hooks (verify_grant reads the
    peer's grant table through them); a two-sided engine overrides _engine_verify_grant."""

    name: str
    timeout_s: float
    pool: KVPool | None
    grants: GrantTable | None

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
        reads the entries through the engine (libkv.transfer.grants.GrantReader) with the read hooks
        below, which one-sided backends implement."""
        reader = GrantReader(self._require_grants(), lambda reads: self._engine_read_grants(peer, reads),
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

    def _run_bytes(self, run: PageRun | ByteRun) -> tuple[int, int, int]:
        """For the write hooks: (source byte offset, destination byte offset, byte length) of a
        run; both pools have the same page size because connect() checked the layouts (a ByteRun,
        a piece of a page for a peer of another TP size, carries its own)."""
        if isinstance(run, ByteRun):
            return run.src, run.dst, run.nbytes
        page_nbytes = self._require_pool().layout.page_nbytes
        return run.src_page * page_nbytes, run.dst_page * page_nbytes, run.length * page_nbytes

    def _require_pool(self) -> KVPool:
        if self.pool is None:
            raise RuntimeError(f"{self.name} backend: register(pool) first")
        return self.pool

    def _require_grants(self) -> GrantTable:
        """The receiver's grant table, made by register() (and registered with the engine by
        _engine_register, which runs after it)."""
        if self.grants is None:
            raise RuntimeError(f"{self.name} backend: register(pool) first")
        return self.grants
