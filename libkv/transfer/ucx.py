"""`ucx` backend: two-sided UCX tagged messages through ucxx (the successor of ucx-py).

UCX from Python has no one-sided put, so the receiver takes part in every write: it posts the
receives into its pool, only for pages its grant table binds to the write's key and grant
(libkv.transfer.ucx_receiver); a write to other pages fails with GrantRefused. This module is the
backend and its sending side. Endpoints are made from
worker addresses with endpoint error handling off, which lets UCX use shared memory (cma/sysv)
between processes on one host: several times faster than its TCP path. The price: a dead peer
makes sends hang instead of fail, so the backend's timeout is what detects it. Pass
`error_handling=True` for peers on other hosts.

Listening: UCX's TCP transport listens on an address of every network device it may use; the
backend sets UCX_NET_DEVICES to the interface holding `host` before UCX starts
(libkv.transfer.ucx_env), so it listens there only. (UCX's shared-memory transports also open
abstract-namespace Unix datagram sockets to signal each other; those have no network address.)

Wire protocol: libkv.transfer.ucx_wire; the receiving side: libkv.transfer.ucx_receiver.

ucxx keeps one UCX context per process, driven from an asyncio loop; the backend runs its own
loop in a thread so callers on any thread (or loop) can use it. One UcxBackend per process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from libkv.pool import KVPool, PageRun
from libkv.transfer import ucx_wire as wire
from libkv.transfer.base import EngineBackend
from libkv.transfer.errors import GrantRefused, PeerUnreachable, TransferError
from libkv.transfer.grants import Refusal
from libkv.transfer.hooks import Peer, Transfer
from libkv.transfer.interface import TransferEndpoint, TransferState
from libkv.transfer.ucx_env import bind_ucx_to
from libkv.transfer.ucx_receiver import UcxReceiver

log = logging.getLogger(__name__)

_instance_lock = threading.Lock()
_instance_alive = False


@dataclass
class _UcxPeer:
    endpoint: Any  # ucxx Endpoint to the receiver
    receiver_uid: int


@dataclass
class _UcxWrite:
    future: Future
    abort_requested: bool = False


class UcxBackend(EngineBackend):
    """ucxx tagged send/recv; see the module docstring for the protocol."""

    name = "ucx"
    one_sided = False

    def __init__(self, *, timeout_s: float = 30.0, host: str = "127.0.0.1",
                 error_handling: bool = False) -> None:
        super().__init__(timeout_s=timeout_s, host=host)
        self._ucxx, self._np = wire.import_ucxx()
        self.error_handling = error_handling
        self.uid = random.SystemRandom().randrange(1, 1 << 31)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._address = b""
        self._pool_bytes: Any = None  # numpy uint8 view of the whole pool
        self._receiver: UcxReceiver | None = None
        self._control_task: asyncio.Task | None = None

    # ---- loop thread -----------------------------------------------------------------------

    def _run(self, coro, timeout: float | None = None):
        """Run a coroutine on the backend's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._started_loop()).result(timeout)

    def _started_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("ucx backend: register(pool) first (it starts the loop)")
        return self._loop

    def _started_receiver(self) -> UcxReceiver:
        if self._receiver is None:
            raise RuntimeError("ucx backend: register(pool) first (it starts the receiver)")
        return self._receiver

    def _engine_register(self, pool: KVPool) -> None:
        global _instance_alive
        with _instance_lock:
            if _instance_alive:
                raise RuntimeError("ucxx keeps one UCX context per process: one UcxBackend per process")
            _instance_alive = True
        try:
            bind_ucx_to(self.host)  # before UCX starts: it reads its settings once
        except Exception:
            with _instance_lock:
                _instance_alive = False
            raise
        self._pool_bytes = pool.as_bytes().numpy()
        receiver = UcxReceiver(self._ucxx, self._np, self._pool_bytes, pool.layout.page_nbytes,
                               self._require_grants(), self._lock, self.timeout_s, self.error_handling)
        self._receiver = receiver
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pdserve-ucx", daemon=True)
        self._thread.start()
        self._address = self._run(self._start(receiver), timeout=60)

    async def _start(self, receiver: UcxReceiver) -> bytes:
        # Python futures: a notifier thread completes requests. Without them every awaited
        # request is polled from the loop with sleep(0), which spins a core even when idle
        # (73% CPU measured here, versus 1.5%, and lower bandwidth under contention).
        if self._ucxx.core._ctx is None:
            self._ucxx.init(progress_mode="thread", enable_python_future=True)
        self._ucxx.continuous_ucx_progress(event_loop=asyncio.get_running_loop())
        address = bytes(self._ucxx.get_worker_address())
        self._control_task = asyncio.ensure_future(receiver.serve_control())
        return address

    def _engine_blob(self) -> bytes:
        return json.dumps({"address": self._address.hex(), "uid": self.uid}).encode()

    # ---- sender ----------------------------------------------------------------------------

    def _engine_connect(self, endpoint: TransferEndpoint) -> Any:
        try:
            raw = json.loads(endpoint.blob)
            address, receiver_uid = bytes.fromhex(raw["address"]), int(raw["uid"])
        except (ValueError, KeyError) as exc:
            raise PeerUnreachable(f"bad ucx endpoint from {endpoint.host}: {exc}") from exc
        try:
            ep = self._run(self._hello(address), timeout=self.timeout_s)
        except FutureTimeout as exc:
            raise PeerUnreachable(f"ucx peer {endpoint.host} did not take the connection "
                                  f"within {self.timeout_s:g} s") from exc
        except Exception as exc:
            raise PeerUnreachable(f"ucx could not connect to {endpoint.host}: {exc}") from exc
        return _UcxPeer(ep, receiver_uid)

    async def _hello(self, address: bytes) -> Any:
        ucx_address = self._ucxx.get_ucx_address_from_buffer(address)
        ep = await self._ucxx.create_endpoint_from_worker_address(
            ucx_address, endpoint_error_handling=self.error_handling)
        mine = bytearray(self._address)
        hello = bytearray(wire.CTRL.pack(wire.HELLO, self.uid, 0, len(mine)))
        await ep.send(hello, tag=wire.CTRL_TAG, force_tag=True)
        await ep.send(mine, tag=wire.addr_tag(self.uid), force_tag=True)
        return ep

    def _engine_write(self, peer: Peer, record: Transfer) -> Any:
        state: _UcxPeer = peer.engine
        pages = _whole_pages(record)
        runs = [self._run_bytes(run) for run in pages]
        header = json.dumps({"key": record.handle.key, "grant": record.grant.hex(),
                             "runs": [[run.dst_page, run.length] for run in pages]}).encode()
        write = _UcxWrite(future=Future())
        write.future = asyncio.run_coroutine_threadsafe(
            self._send(state.endpoint, write, record.handle.transfer_id, header, runs), self._started_loop())
        write.future.add_done_callback(lambda _: record.wakeup.set())
        return write

    def _post_header(self, ep: Any, kinds: tuple[int, int], request_id: int, header: bytes,
                     sends: list[asyncio.Task], post) -> None:
        """Send the control message of a request: the header inline if it fits, else after it
        on the request's DATA tag (kinds = (inline kind, long kind))."""
        if wire.CTRL.size + len(header) <= wire.CTRL_NBYTES:
            begin = wire.CTRL.pack(kinds[0], self.uid, request_id, len(header)) + header
            sends.append(asyncio.ensure_future(ep.send(bytearray(begin), tag=wire.CTRL_TAG, force_tag=True)))
        else:
            begin = wire.CTRL.pack(kinds[1], self.uid, request_id, len(header))
            sends.append(asyncio.ensure_future(ep.send(bytearray(begin), tag=wire.CTRL_TAG, force_tag=True)))
            post(bytearray(header))

    async def _send(self, ep: Any, write: _UcxWrite, transfer_id: int, header: bytes,
                    runs: list[tuple[int, int, int]]) -> tuple[int, int, int]:
        tag = wire.data_tag(self.uid, transfer_id)
        ack = bytearray(wire.ACK.size)
        # Post the ack receive first so the ack can never arrive unmatched.
        ack_recv = asyncio.ensure_future(self._ucxx.recv(ack, tag=wire.ack_tag(self.uid, transfer_id)))
        sends: list[asyncio.Task] = []

        def post(buffer) -> None:
            # Each send is posted to UCX when its task first runs, and tasks run in creation
            # order, so messages leave in this order without waiting for one another.
            sends.append(asyncio.ensure_future(ep.send(buffer, tag=tag, force_tag=True)))

        try:
            self._post_header(ep, (wire.BEGIN, wire.BEGIN_LONG), transfer_id, header, sends, post)
            aborted, sent = 0, 0
            for src, _dst, nbytes in runs:
                if write.abort_requested:
                    aborted = 1
                    post(bytearray(0))  # completes the receiver's posted receive, writes nothing
                    continue
                post(self._pool_bytes[src:src + nbytes])
                sent += 1
                # Keep a few runs in flight: enough to overlap, few enough that an abort stops
                # the rest of a long transfer.
                while len(sends) > 3:
                    await sends.pop(0)
            post(bytearray(wire.END.pack(wire.END_KIND, aborted, sent)))
            await asyncio.gather(*sends)
            await ack_recv
        finally:
            for task in [*sends, ack_recv]:
                if not task.done():
                    task.cancel()
        status, refused, _, first_refused = wire.ACK.unpack(ack)
        return status, refused, first_refused

    def _engine_progress(self, record: Transfer) -> TransferState:
        future = record.engine.future
        if not future.done():
            return TransferState.PENDING
        if future.cancelled():
            record.error = PeerUnreachable(f"ucx write {record.handle.transfer_id} cancelled")
            return TransferState.FAILED
        exc = future.exception()
        if exc is not None:
            record.error = PeerUnreachable(f"ucx write {record.handle.transfer_id} to "
                                           f"{record.handle.peer} failed: {exc}")
            return TransferState.FAILED
        status, refused, first_refused = future.result()
        if status == wire.ACK_OK:
            return TransferState.DONE
        if status == wire.ACK_REJECTED:
            refusal = Refusal(first_refused, refused, record.handle.num_pages)
            record.error = GrantRefused(
                f"ucx receiver rejected write {record.handle.transfer_id} (key {record.handle.key!r}): "
                f"page {first_refused} is not reserved for this key and grant ({refused} of "
                f"{refusal.total} pages refused; none of the refused runs reached the pool)", refusal)
        else:
            record.error = TransferError(f"ucx receiver answered write {record.handle.transfer_id} "
                                         f"with status {status}")
        return TransferState.FAILED

    def _engine_verify_grant(self, peer: Peer, pages: list[int], key: str, grant: bytes,
                             tag: bytes) -> Refusal | None:
        """Ask the receiver to compare its entries (the same check its writes get); the answer
        comes back like a write's ack. Optional for safety, since every write is checked too,
        but it refuses a forged request before the prefill computes anything."""
        state: _UcxPeer = peer.engine
        runs: list[list[int]] = []
        for page in pages:
            if runs and page == runs[-1][0] + runs[-1][1]:
                runs[-1][1] += 1
            else:
                runs.append([page, 1])
        header = json.dumps({"key": key, "grant": grant.hex(), "runs": runs}).encode()
        request_id = next(self._ids)
        try:
            status, refused, first_refused = self._run(
                self._ask_verify(state.endpoint, request_id, header), timeout=self.timeout_s)
        except FutureTimeout as exc:
            raise PeerUnreachable(f"ucx peer {peer.endpoint.host} did not answer a grant check within "
                                  f"{self.timeout_s:g} s") from exc
        except Exception as exc:
            raise PeerUnreachable(f"ucx grant check with {peer.endpoint.host} failed: {exc}") from exc
        if status == wire.ACK_OK:
            return None
        return Refusal(first_refused, refused, len(pages))

    async def _ask_verify(self, ep: Any, request_id: int, header: bytes) -> tuple[int, int, int]:
        ack = bytearray(wire.ACK.size)
        ack_recv = asyncio.ensure_future(self._ucxx.recv(ack, tag=wire.ack_tag(self.uid, request_id)))
        sends: list[asyncio.Task] = []
        tag = wire.data_tag(self.uid, request_id)

        def post(buffer) -> None:
            sends.append(asyncio.ensure_future(ep.send(buffer, tag=tag, force_tag=True)))

        try:
            self._post_header(ep, (wire.VERIFY, wire.VERIFY_LONG), request_id, header, sends, post)
            await asyncio.gather(*sends)
            await ack_recv
        finally:
            for task in [*sends, ack_recv]:
                if not task.done():
                    task.cancel()
        status, refused, _, first_refused = wire.ACK.unpack(ack)
        return status, refused, first_refused

    def _engine_cancel(self, record: Transfer, deadline: float) -> None:
        write: _UcxWrite | None = record.engine
        if write is None or write.future.done():
            return
        write.abort_requested = True  # the sender stops before its next run and sends END
        try:
            write.future.result(timeout=max(deadline - time.monotonic(), 0.0))
        except FutureTimeout:
            # The peer does not answer: stop waiting for it. Its pages get nothing more from us
            # because the peer is dead; a live peer would have acked.
            write.future.cancel()
        except Exception:
            pass

    def _engine_disconnect(self, peer: Peer) -> None:
        state: _UcxPeer = peer.engine
        if state is not None and self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(wire.abort_endpoint, state.endpoint)

    # ---- receiver (libkv.transfer.ucx_receiver) ---------------------------------------------

    def _engine_release(self, key: str, pages: frozenset[int]) -> None:
        self._started_receiver().release(key)

    # ---- shutdown --------------------------------------------------------------------------

    def _engine_close(self) -> None:
        global _instance_alive
        if self._loop is None:
            return

        async def shutdown() -> None:
            if self._control_task is not None:
                self._control_task.cancel()
            await self._started_receiver().close()

        try:
            self._run(shutdown(), timeout=10)
        except Exception:
            log.exception("ucx: shutdown failed")
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._loop = None
        with _instance_lock:
            _instance_alive = False



def _whole_pages(record: Transfer) -> list[PageRun]:
    """A write's runs, whole pages: ucx's protocol moves nothing else (`writes_regions` is False,
    so connect() never routes a peer of another TP size here)."""
    pages = [run for run in record.runs if isinstance(run, PageRun)]
    if len(pages) != len(record.runs):
        raise TypeError("ucx moves whole pages only, got byte regions")
    return pages
