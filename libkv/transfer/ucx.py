"""`ucx` backend: two-sided UCX tagged messages through ucxx (the successor of ucx-py).

UCX from Python has no one-sided put, so the receiver takes part: it receives each page run
directly into its pool's page region (a view, no copy), but only where its grant table binds
every page of the run to tag(key, grant) of the write's header (libkv.transfer.grants), i.e.
pages that expect() reserved for that key and grant; anything else is received into scratch
memory and dropped, and the sender's write fails with GrantRefused. Endpoints are made from
worker addresses with endpoint error handling off, which lets UCX use shared memory (cma/sysv)
between processes on one host: several times faster than its TCP path. The price: a dead peer
makes sends hang instead of fail, so the backend's timeout is what detects it. Pass
`error_handling=True` for peers on other hosts.

Listening: UCX's TCP transport listens on an address of every network device it may use; the
backend sets UCX_NET_DEVICES to the interface holding `host` before UCX starts
(libkv.transfer.ucx_env), so it listens there only. (UCX's shared-memory transports also open
abstract-namespace Unix datagram sockets to signal each other; those have no network address.)

Wire protocol (all tags forced, 64-bit; see the *_tag functions):
  connect:   sender -> receiver  CTRL   HELLO(sender uid, address length)
             sender -> receiver  ADDR   sender's worker address (the receiver's route for acks)
  write:     sender -> receiver  CTRL   BEGIN(sender uid, transfer id, header length) followed
                                        in the same message by the header JSON
                                        {key, grant (hex), runs: [[dst_page, length], ...]}; a
                                        header too big for CTRL_NBYTES goes separately on DATA
                                        (BEGIN_LONG)
             per run, in order:  DATA   the run's bytes, or an empty message once aborted
             finally             DATA   END(aborted?)
             receiver -> sender  ACK    (status, refused pages, transfer id, first refused page):
                                        OK, REJECTED (some run not granted: those runs went to
                                        scratch) or ABORTED
  verify:    sender -> receiver  CTRL   VERIFY(sender uid, request id, header length) + header
                                        {key, grant, runs} (VERIFY_LONG: header on DATA)
             receiver -> sender  ACK    OK or REJECTED, as for a write; nothing else moves
UCX matches messages of one tag from one endpoint in send order, so after the header the
receiver posts every run's receive at once (into pool pages if the grant covers them, else
into scratch) and then one for END. A sender that aborts still sends one message per run, empty,
which completes the posted receive without writing a byte: no receive stays posted into pool
pages waiting for data that will not come (unless the sender dies; then nothing can match it).

ucxx keeps one UCX context per process, driven from an asyncio loop; the backend runs its own
loop in a thread so callers on any thread (or loop) can use it. One UcxBackend per process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import struct
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from libkv.pool import KVPool
from libkv.transfer.base import (
    EngineUnavailable,
    GrantRefused,
    Peer,
    PeerUnreachable,
    Transfer,
    TransferBackend,
    TransferEndpoint,
    TransferError,
    TransferState,
)
from libkv.transfer.grants import Refusal, grant_tag
from libkv.transfer.ucx_env import bind_ucx_to

log = logging.getLogger(__name__)

CTRL_TAG = 0x5044_C7C7_0000_0001
_CTRL = struct.Struct("<IIQQ")  # kind, sender uid, transfer id, length
_END = struct.Struct("<IIQ")  # END kind, aborted flag, runs sent with data
_ACK = struct.Struct("<IIQQ")  # status, refused pages, transfer id, first refused page
_HELLO, _BEGIN, _BEGIN_LONG, _VERIFY, _VERIFY_LONG = 1, 2, 3, 4, 5
CTRL_NBYTES = 4096  # receive buffer of control messages (a smaller message fits): ~300 runs
_END_KIND = 0x454E44
ACK_OK, ACK_REJECTED, ACK_ABORTED = 0, 1, 2

_instance_lock = threading.Lock()
_instance_alive = False


def data_tag(sender_uid: int, transfer_id: int) -> int:
    return (1 << 62) | (sender_uid << 31) | (transfer_id & 0x7FFF_FFFF)


def ack_tag(sender_uid: int, transfer_id: int) -> int:
    return (2 << 62) | (sender_uid << 31) | (transfer_id & 0x7FFF_FFFF)


def addr_tag(sender_uid: int) -> int:
    return (3 << 62) | (sender_uid << 31)


def _import_ucxx():
    try:
        import numpy
        import ucxx
    except ImportError as exc:
        raise EngineUnavailable("the ucx backend needs pip install ucxx-cu12==0.52.0 "
                                "(ucx-py cannot be installed from PyPI)") from exc
    return ucxx, numpy


@dataclass
class _UcxPeer:
    endpoint: Any  # ucxx Endpoint to the receiver
    receiver_uid: int


@dataclass
class _UcxWrite:
    future: Future
    abort_requested: bool = False


class UcxBackend(TransferBackend):
    """ucxx tagged send/recv; see the module docstring for the protocol."""

    name = "ucx"
    one_sided = False

    def __init__(self, *, timeout_s: float = 30.0, host: str = "127.0.0.1",
                 error_handling: bool = False) -> None:
        super().__init__(timeout_s=timeout_s, host=host)
        self._ucxx, self._np = _import_ucxx()
        self.error_handling = error_handling
        self.uid = random.SystemRandom().randrange(1, 1 << 31)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._address = b""
        self._pool_bytes: Any = None  # numpy uint8 view of the whole pool
        self._senders: dict[int, asyncio.Future] = {}  # sender uid -> (future) endpoint for acks
        self._background: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks
        self._inflight: dict[str, int] = {}  # key -> receives posted into pool pages
        self._inflight_done = threading.Condition(self._lock)
        self._control_task: asyncio.Task | None = None

    # ---- loop thread -----------------------------------------------------------------------

    def _run(self, coro, timeout: float | None = None):
        """Run a coroutine on the backend's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

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
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pdserve-ucx", daemon=True)
        self._thread.start()
        self._address = self._run(self._start(), timeout=60)

    async def _start(self) -> bytes:
        # Python futures: a notifier thread completes requests. Without them every awaited
        # request is polled from the loop with sleep(0), which spins a core even when idle
        # (73% CPU measured here, versus 1.5%, and lower bandwidth under contention).
        if self._ucxx.core._ctx is None:
            self._ucxx.init(progress_mode="thread", enable_python_future=True)
        self._ucxx.continuous_ucx_progress(event_loop=asyncio.get_running_loop())
        address = bytes(self._ucxx.get_worker_address())
        self._control_task = asyncio.ensure_future(self._serve_control())
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
        await ep.send(bytearray(_CTRL.pack(_HELLO, self.uid, 0, len(mine))), tag=CTRL_TAG, force_tag=True)
        await ep.send(mine, tag=addr_tag(self.uid), force_tag=True)
        return ep

    def _engine_write(self, peer: Peer, record: Transfer) -> Any:
        state: _UcxPeer = peer.engine
        runs = [self._run_bytes(run) for run in record.runs]
        header = json.dumps({"key": record.handle.key, "grant": record.grant.hex(),
                             "runs": [[run.dst_page, run.length] for run in record.runs]}).encode()
        write = _UcxWrite(future=Future())
        write.future = asyncio.run_coroutine_threadsafe(
            self._send(state.endpoint, write, record.handle.transfer_id, header, runs), self._loop)
        write.future.add_done_callback(lambda _: record.wakeup.set())
        return write

    def _post_header(self, ep: Any, kinds: tuple[int, int], request_id: int, header: bytes,
                     sends: list[asyncio.Task], post) -> None:
        """Send the control message of a request: the header inline if it fits, else after it
        on the request's DATA tag (kinds = (inline kind, long kind))."""
        if _CTRL.size + len(header) <= CTRL_NBYTES:
            begin = _CTRL.pack(kinds[0], self.uid, request_id, len(header)) + header
            sends.append(asyncio.ensure_future(ep.send(bytearray(begin), tag=CTRL_TAG, force_tag=True)))
        else:
            begin = _CTRL.pack(kinds[1], self.uid, request_id, len(header))
            sends.append(asyncio.ensure_future(ep.send(bytearray(begin), tag=CTRL_TAG, force_tag=True)))
            post(bytearray(header))

    async def _send(self, ep: Any, write: _UcxWrite, transfer_id: int, header: bytes,
                    runs: list[tuple[int, int, int]]) -> tuple[int, int, int]:
        tag = data_tag(self.uid, transfer_id)
        ack = bytearray(_ACK.size)
        # Post the ack receive first so the ack can never arrive unmatched.
        ack_recv = asyncio.ensure_future(self._ucxx.recv(ack, tag=ack_tag(self.uid, transfer_id)))
        sends: list[asyncio.Task] = []

        def post(buffer) -> None:
            # Each send is posted to UCX when its task first runs, and tasks run in creation
            # order, so messages leave in this order without waiting for one another.
            sends.append(asyncio.ensure_future(ep.send(buffer, tag=tag, force_tag=True)))

        try:
            self._post_header(ep, (_BEGIN, _BEGIN_LONG), transfer_id, header, sends, post)
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
            post(bytearray(_END.pack(_END_KIND, aborted, sent)))
            await asyncio.gather(*sends)
            await ack_recv
        finally:
            for task in [*sends, ack_recv]:
                if not task.done():
                    task.cancel()
        status, refused, _, first_refused = _ACK.unpack(ack)
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
        if status == ACK_OK:
            return TransferState.DONE
        if status == ACK_REJECTED:
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
        if status == ACK_OK:
            return None
        return Refusal(first_refused, refused, len(pages))

    async def _ask_verify(self, ep: Any, request_id: int, header: bytes) -> tuple[int, int, int]:
        ack = bytearray(_ACK.size)
        ack_recv = asyncio.ensure_future(self._ucxx.recv(ack, tag=ack_tag(self.uid, request_id)))
        sends: list[asyncio.Task] = []
        tag = data_tag(self.uid, request_id)

        def post(buffer) -> None:
            sends.append(asyncio.ensure_future(ep.send(buffer, tag=tag, force_tag=True)))

        try:
            self._post_header(ep, (_VERIFY, _VERIFY_LONG), request_id, header, sends, post)
            await asyncio.gather(*sends)
            await ack_recv
        finally:
            for task in [*sends, ack_recv]:
                if not task.done():
                    task.cancel()
        status, refused, _, first_refused = _ACK.unpack(ack)
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
            self._loop.call_soon_threadsafe(_abort_endpoint, state.endpoint)

    # ---- receiver --------------------------------------------------------------------------

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _serve_control(self) -> None:
        message = bytearray(CTRL_NBYTES)
        while True:
            try:
                await self._ucxx.recv(message, tag=CTRL_TAG)
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad message must not stop every later transfer
                log.exception("ucx: receiving a control message failed")
                await asyncio.sleep(0.01)
                continue
            kind, sender, transfer_id, length = _CTRL.unpack_from(message)
            if kind == _HELLO:
                route = asyncio.get_running_loop().create_future()
                old = self._senders.get(sender)
                self._senders[sender] = route
                self._spawn(self._accept_sender(sender, length, route, old))
            elif kind == _BEGIN:
                header = bytes(message[_CTRL.size:_CTRL.size + length])  # the buffer is reused
                self._spawn(self._receive(sender, transfer_id, header))
            elif kind == _BEGIN_LONG:
                self._spawn(self._receive(sender, transfer_id, length))
            elif kind == _VERIFY:
                header = bytes(message[_CTRL.size:_CTRL.size + length])
                self._spawn(self._answer_verify(sender, transfer_id, header))
            elif kind == _VERIFY_LONG:
                self._spawn(self._answer_verify(sender, transfer_id, length))
            else:
                log.warning("ucx: unknown control message kind %d from %x", kind, sender)

    async def _accept_sender(self, sender: int, length: int, route: asyncio.Future,
                             old: asyncio.Future | None) -> None:
        """Make the endpoint that carries acks back to a sender that said HELLO."""
        try:
            address = bytearray(length)
            await asyncio.wait_for(self._ucxx.recv(address, tag=addr_tag(sender)), self.timeout_s)
            ep = await self._ucxx.create_endpoint_from_worker_address(
                self._ucxx.get_ucx_address_from_buffer(bytes(address)),
                endpoint_error_handling=self.error_handling)
        except Exception as exc:
            log.warning("ucx: HELLO from sender %x failed: %s", sender, exc)
            route.set_exception(PeerUnreachable(f"no route back to ucx sender {sender:x}: {exc}"))
            return
        route.set_result(ep)
        if old is not None and old is not route and old.done() and old.exception() is None:
            _abort_endpoint(old.result())

    async def _read_header(self, sender: int, request_id: int,
                           header: bytes | int) -> tuple[str, bytes | None, list]:
        """(key, tag, runs) of a request; `header` is the header itself, or its length if it
        follows on the request's DATA tag. A grant that does not parse gives tag None, which
        no page matches."""
        if isinstance(header, int):
            buffer = bytearray(header)
            await self._ucxx.recv(buffer, tag=data_tag(sender, request_id))
            header = bytes(buffer)
        spec = json.loads(header)
        key = spec["key"]
        try:
            tag = grant_tag(key, bytes.fromhex(spec.get("grant", "")))
        except (ValueError, TypeError):
            tag = None
        return key, tag, spec["runs"]

    def _check_run(self, dst: int, length: int, tag: bytes | None) -> Refusal | None:
        """Whether the grant table binds every page of the run to `tag` (hold self._lock)."""
        if tag is None or dst < 0 or length < 1 or dst + length > self.grants.num_pages:
            return Refusal(dst, max(length, 0), max(length, 0))
        return self.grants.check(dst, length, tag)

    async def _answer_verify(self, sender: int, request_id: int, header: bytes | int) -> None:
        status, refused, first_refused = ACK_OK, 0, 0
        try:
            _key, tag, runs = await self._read_header(sender, request_id, header)
            with self._lock:
                for dst, length in runs:
                    refusal = self._check_run(dst, length, tag)
                    if refusal is not None:
                        first_refused = first_refused if refused else refusal.first_page
                        refused += refusal.count
                        status = ACK_REJECTED
        except Exception as exc:  # a malformed request is refused, never crashes the receiver
            log.warning("ucx: bad grant check %d from %x: %s", request_id, sender, exc)
            status = ACK_REJECTED
        await self._ack(sender, request_id, status, refused, first_refused)

    async def _ack(self, sender: int, request_id: int, status: int, refused: int, first_refused: int) -> None:
        route = self._senders.get(sender)
        if route is None:
            log.warning("ucx: no route back to sender %x for request %d", sender, request_id)
            return
        try:
            ep = await asyncio.wait_for(asyncio.shield(route), self.timeout_s)
            await ep.send(bytearray(_ACK.pack(status, refused, request_id, first_refused)),
                          tag=ack_tag(sender, request_id), force_tag=True)
        except Exception as exc:
            log.warning("ucx: ack of request %d to sender %x failed: %s", request_id, sender, exc)

    async def _receive(self, sender: int, transfer_id: int, header: bytes | int) -> None:
        """Receive one transfer; `header` is the header itself, or its length if it follows."""
        tag = data_tag(sender, transfer_id)
        key, run_tag, runs = await self._read_header(sender, transfer_id, header)
        page_nbytes = self._require_pool().layout.page_nbytes
        targets, scratch_nbytes, in_pool, refused, first_refused = [], 0, 0, 0, 0
        with self._lock:
            for dst, length in runs:
                refusal = self._check_run(dst, length, run_tag)
                if refusal is None:
                    targets.append(self._pool_bytes[dst * page_nbytes:(dst + length) * page_nbytes])
                    in_pool += 1
                else:
                    targets.append(None)
                    scratch_nbytes = max(scratch_nbytes, length * page_nbytes)
                    first_refused = first_refused if refused else refusal.first_page
                    refused += refusal.count
            if in_pool:
                self._inflight[key] = self._inflight.get(key, 0) + in_pool
        # Rejected runs all land in one scratch buffer: their bytes are dropped anyway.
        scratch = self._np.empty(scratch_nbytes, dtype=self._np.uint8) if scratch_nbytes else None
        end = bytearray(_END.size)
        receives = [asyncio.ensure_future(self._receive_run(key, target, scratch, tag)) for target in targets]
        end_receive = asyncio.ensure_future(self._ucxx.recv(end, tag=tag))
        await asyncio.gather(*receives, return_exceptions=True)
        await end_receive
        kind, aborted, _ = _END.unpack(end)
        if kind != _END_KIND:
            log.warning("ucx: transfer %d from %x ended without END", transfer_id, sender)
        status = ACK_ABORTED if aborted else (ACK_OK if in_pool == len(targets) else ACK_REJECTED)
        await self._ack(sender, transfer_id, status, refused, first_refused)

    async def _receive_run(self, key: str, target: Any, scratch: Any, tag: int) -> None:
        if target is None:
            await self._ucxx.recv(scratch, tag=tag)
            return
        try:
            await self._ucxx.recv(target, tag=tag)
        finally:
            with self._inflight_done:
                self._inflight[key] -= 1
                if not self._inflight[key]:
                    del self._inflight[key]
                self._inflight_done.notify_all()

    def _engine_release(self, key: str, pages: frozenset[int]) -> None:
        # Receives already posted into this key's pages complete with the sender's bytes or with
        # an empty message if it aborts: wait for them (bounded, in case the sender died) so
        # that nothing lands after we return.
        deadline = time.monotonic() + self.timeout_s
        with self._inflight_done:
            while self._inflight.get(key) and time.monotonic() < deadline:
                self._inflight_done.wait(timeout=0.05)
            if self._inflight.get(key):
                log.warning("ucx: receives for %r still posted after %.1f s (sender dead?)", key,
                            self.timeout_s)

    # ---- shutdown --------------------------------------------------------------------------

    def _engine_close(self) -> None:
        global _instance_alive
        if self._loop is None:
            return

        async def shutdown() -> None:
            if self._control_task is not None:
                self._control_task.cancel()
            for task in list(self._background):
                task.cancel()
            for route in self._senders.values():
                if route.done() and not route.cancelled() and route.exception() is None:
                    _abort_endpoint(route.result())
            self._senders.clear()

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


def _abort_endpoint(ep: Any) -> None:
    try:
        ep.abort(period=10**9)  # bounded: the peer may be gone
    except Exception:
        pass
