"""`mooncake` backend: one-sided writes through Mooncake's TransferEngine, P2P handshake.

No metadata server: the engine is initialized with "P2PHANDSHAKE" and peers address each other
by session id `host:rpc_port`, carried (with the pool's base address and size) in the endpoint
blob. Protocol "tcp" here; "rdma" where `ib_device` names an RDMA device (with no RDMA card
Mooncake silently falls back to TCP). Each page run is one asynchronous engine write
(transfer_submit_write) polled with transfer_check_status; this engine version acknowledges a
TCP write only after the receiver applied it, so DONE means the bytes are in remote memory.

Grants: the grant table (libkv.transfer.grants) is registered next to the pool and its address
travels in the blob; verify_grant reads the peer's entries with batch_transfer_async_read (one
batch per span of nearby pages, usually one) into a registered local read slot and polls it
like a write, so a frozen peer costs at most timeout_s, not Mooncake's own transfer timeout.

Listening: Mooncake 0.3.13 opens two listeners while it initializes, the P2P handshake socket
(its rpc port) and the TCP transport's acceptor, and both bind the wildcard address in its code
(INADDR_ANY; in6addr_any with IPV6_V6ONLY off). MC_TCP_BIND_ADDRESS does not change that: it only
picks the address advertised when a metadata server is used, and is ignored with P2PHANDSHAKE.
So initialize() runs under libkv.transfer.bind_host.bind_wildcard_to(host): both listeners
bind `host` (the acceptor as ::ffff:host when host is IPv4). If the engine's libraries cannot be
patched (another platform or build), the backend logs a warning and the listeners stay on the
wildcard address.
"""

from __future__ import annotations

import functools
import glob
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from libkv.pool import KVPool
from libkv.transfer.base import EngineBackend
from libkv.transfer.bind_host import bind_wildcard_to, is_wildcard
from libkv.transfer.errors import EngineUnavailable, PeerUnreachable
from libkv.transfer.grants import TAG_NBYTES
from libkv.transfer.hooks import Peer, Transfer
from libkv.transfer.interface import TransferEndpoint, TransferState

log = logging.getLogger(__name__)

# transfer_check_status results (Mooncake's Python binding)
_MC_DONE, _MC_PENDING, _MC_FAILED, _MC_TIMEOUT = 1, 0, -1, -2
# Batch ids are addresses; a refused submission is 0 in newer bindings and negative (or its
# unsigned image) in older ones.
_MC_BAD_BATCH = (0, (1 << 64) - 1)


_INITIALIZE_ATTEMPTS = 4


def _import_engine():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise EngineUnavailable(
            "the mooncake backend needs pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 "
            "and apt-get install -y libibverbs1 (the CUDA wheel does not import without a driver)"
        ) from exc
    return TransferEngine


@dataclass
class _MooncakePeer:
    session: str
    base_addr: int
    nbytes: int
    grants_addr: int


@dataclass
class _MooncakeWrite:
    pending: list[int] = field(default_factory=list)  # batch ids submitted and not yet finished
    failed: int = 0


_MAX_QUEUED_LIMIT = 65535  # the largest MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER Mooncake accepts


class MooncakeBackend(EngineBackend):
    """Mooncake TransferEngine over TCP (or RDMA with `ib_device`).

    `max_queued_per_peer` sets MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER in this process's
    environment before the engine starts: it is the engine's own knob (read only from the
    environment), and its default rejects the many 64 KiB slices of one large transfer. This is
    the one place pdserve writes an environment variable, and only for the engine's sake.
    Abort: Mooncake cannot cancel a submitted write, so abort() waits (bounded) until every
    submitted run has finished or failed.
    """

    name = "mooncake"
    writes_regions = True

    @classmethod
    def supports_device_memory(cls) -> bool:
        return _is_cuda_build()

    def __init__(self, *, timeout_s: float = 30.0, host: str = "127.0.0.1", protocol: str = "",
                 ib_device: str = "", max_queued_per_peer: int = 32768) -> None:
        super().__init__(timeout_s=timeout_s, host=host)
        if not 1 <= max_queued_per_peer <= _MAX_QUEUED_LIMIT:
            # Mooncake itself would log a warning and silently fall back to its default of 1024.
            raise ValueError(f"max_queued_per_peer must be in 1..{_MAX_QUEUED_LIMIT}, "
                             f"got {max_queued_per_peer}")
        self.protocol = protocol or ("rdma" if ib_device else "tcp")
        self.ib_device = ib_device
        self.max_queued_per_peer = max_queued_per_peer
        self._engine_cls = _import_engine()
        self._engine: Any = None
        self._session = ""

    def _engine_register(self, pool: KVPool) -> None:
        os.environ["MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"] = str(self.max_queued_per_peer)
        engine = self._initialized_engine()
        if engine.register_memory(pool.data_ptr(), pool.nbytes) != 0:
            raise RuntimeError(f"Mooncake could not register the KV pool ({pool.nbytes} bytes)")
        grants = self._require_grants().memory
        if engine.register_memory(grants.data_ptr(), grants.numel()) != 0:
            raise RuntimeError(f"Mooncake could not register the grant table ({grants.numel()} bytes)")
        self._engine = engine
        self._session = f"{self.host}:{engine.get_rpc_port()}"

    def _initialized_engine(self) -> Any:
        """A started engine. Under P2PHANDSHAKE the engine picks its own listening ports (the RPC
        handshake daemon, the TCP transport) by probing for a free one and binding it afterwards:
        another process can take the port in between (workers starting together do), and then
        initialize fails. A fresh engine probes again, so a few attempts make that race harmless."""
        call = (f"Mooncake TransferEngine.initialize({self.host!r}, P2PHANDSHAKE, {self.protocol!r}, "
                f"{self.ib_device!r})")
        for attempt in range(1, _INITIALIZE_ATTEMPTS + 1):
            engine = self._engine_cls()
            with bind_wildcard_to(self.host, _engine_libraries()) as patch:
                status = engine.initialize(self.host, "P2PHANDSHAKE", self.protocol, self.ib_device)
            if not patch.patched and not is_wildcard(self.host):
                log.warning("mooncake: could not make the engine bind %s only (%s); its listeners bind "
                            "every address", self.host, patch.skipped)
            if status == 0:
                return engine
            log.warning("mooncake: %s failed (attempt %d of %d; a listening port it chose may have been "
                        "taken meanwhile)", call, attempt, _INITIALIZE_ATTEMPTS)
        raise RuntimeError(f"{call} failed {_INITIALIZE_ATTEMPTS} times")

    def _engine_blob(self) -> bytes:
        pool = self._require_pool()
        return json.dumps({"session": self._session, "base": pool.data_ptr(), "nbytes": pool.nbytes,
                           "grants": self._require_grants().address()}).encode()

    def _engine_connect(self, endpoint: TransferEndpoint) -> Any:
        try:
            raw = json.loads(endpoint.blob)
            peer = _MooncakePeer(str(raw["session"]), int(raw["base"]), int(raw["nbytes"]),
                                 int(raw["grants"]))
        except (ValueError, KeyError) as exc:
            raise PeerUnreachable(f"bad mooncake endpoint from {endpoint.host}: {exc}") from exc
        # The handshake (segment descriptor exchange) happens on the first write; a probe
        # fails fast here instead if nobody answers at that session.
        probe = getattr(self._engine, "send_probe", None)
        if probe is not None and probe(peer.session) != 0:
            raise PeerUnreachable(f"mooncake peer {peer.session} does not answer")
        return peer

    def _engine_write(self, peer: Peer, record: Transfer) -> Any:
        state: _MooncakePeer = peer.engine
        base = self._require_pool().data_ptr()
        write = _MooncakeWrite()
        for run in record.runs:
            src, dst, nbytes = self._run_bytes(run)
            batch = self._engine.transfer_submit_write(state.session, base + src, state.base_addr + dst,
                                                       nbytes)
            if batch < 0 or batch in _MC_BAD_BATCH:
                write.failed += 1
                break
            write.pending.append(batch)
        if write.failed:
            record.engine = write
            self._engine_cancel(record, time.monotonic() + self.timeout_s)
            raise PeerUnreachable(f"mooncake refused a write to {state.session}")
        return write

    def _check(self, write: _MooncakeWrite) -> None:
        still = []
        for batch in write.pending:
            status = self._engine.transfer_check_status(batch)
            if status == _MC_PENDING:
                still.append(batch)
            elif status != _MC_DONE:
                write.failed += 1
        write.pending = still

    def _engine_progress(self, record: Transfer) -> TransferState:
        write: _MooncakeWrite = record.engine
        self._check(write)
        if write.failed:
            record.error = PeerUnreachable(f"mooncake write {record.handle.transfer_id} to "
                                           f"{record.handle.peer}: {write.failed} run(s) failed")
            return TransferState.FAILED
        return TransferState.DONE if not write.pending else TransferState.PENDING

    def _engine_cancel(self, record: Transfer, deadline: float) -> None:
        write: _MooncakeWrite | None = record.engine
        while write is not None and write.pending and time.monotonic() < deadline:
            self._check(write)
            if write.pending:
                time.sleep(0.001)

    # ---- grant reads (verify_grant) ---------------------------------------------------------

    def _engine_read_grants(self, peer: Peer, reads: list[tuple[int, int, int]]) -> Any:
        # One batch per span: this binding reports the status of a batch's first request only,
        # so a batch of several could not be polled.
        state: _MooncakePeer = peer.engine
        op = _MooncakeWrite()
        for local, first, count in reads:
            batch = self._engine.batch_transfer_async_read(
                state.session, [local], [state.grants_addr + first * TAG_NBYTES], [count * TAG_NBYTES])
            if batch < 0 or batch in _MC_BAD_BATCH:
                op.failed += 1
                break
            op.pending.append(batch)
        return op

    def _engine_read_progress(self, op: _MooncakeWrite) -> TransferState:
        self._check(op)
        if op.pending:  # even after a failure: the slot is reused only once nothing can land
            return TransferState.PENDING
        return TransferState.FAILED if op.failed else TransferState.DONE

    def _engine_close(self) -> None:
        if self._engine is not None and self.pool is not None and self.grants is not None:
            for address in (self.pool.data_ptr(), self.grants.address()):
                try:
                    self._engine.unregister_memory(address)
                except Exception:
                    pass
        self._engine = None


@functools.cache
def _is_cuda_build() -> bool:
    """Whether the Mooncake installed here was built with CUDA (it links the CUDA runtime): only such a
    build copies through GPU memory; the non-CUDA build would read a device pointer as host memory.
    Read from the engine library itself: the wheel's name differs per CUDA major, and an install
    copied without its metadata still says it here."""
    with open(_engine_libraries()[0], "rb") as library:
        return b"libcudart.so" in library.read()


def _engine_libraries() -> list[str]:
    """The Mooncake shared objects that may call bind(): the Python module and its own libs."""
    import mooncake.engine

    folder = os.path.dirname(mooncake.engine.__file__)
    return [mooncake.engine.__file__, *sorted(glob.glob(os.path.join(folder, "lib*.so")))]
