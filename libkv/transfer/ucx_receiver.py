"""The receiving side of the `ucx` backend: it posts the receives that write into the pool.

UCX from Python has no one-sided put, so the receiver takes part in every write: it receives each
page run directly into its pool's page region (a view, no copy), but only where its grant table
binds every page of the run to tag(key, grant) of the write's header (libkv.transfer.grants);
anything else is received into scratch memory and dropped, and the sender's write fails with
GrantRefused. It also answers the senders' grant checks (VERIFY) with the same comparison.
Messages and tags: libkv.transfer.ucx_wire. Everything here runs on the backend's event loop,
but for release(), which the receiver's service calls from its own thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Any

from libkv.transfer import ucx_wire as wire
from libkv.transfer.errors import PeerUnreachable
from libkv.transfer.grants import GrantTable, Refusal, grant_tag

log = logging.getLogger("libkv.transfer.ucx")


class UcxReceiver:
    """Serves the CTRL tag of one UcxBackend: HELLOs (a route back for acks), writes, verifies.

    `lock` is the backend's lock: expect() and release_expectation() change the grant table
    under it, and each write's runs are checked against the table under it too.
    """

    def __init__(self, ucxx: Any, numpy: Any, pool_bytes: Any, page_nbytes: int, grants: GrantTable,
                 lock: threading.RLock, timeout_s: float, error_handling: bool) -> None:
        self._ucxx, self._np = ucxx, numpy
        self._pool_bytes = pool_bytes  # numpy uint8 view of the whole pool
        self._page_nbytes = page_nbytes
        self._grants = grants
        self._lock = lock
        self._timeout_s = timeout_s
        self._error_handling = error_handling
        self._senders: dict[int, asyncio.Future] = {}  # sender uid -> (future) endpoint for acks
        self._background: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks
        self._inflight: dict[str, int] = {}  # key -> receives posted into pool pages
        self._inflight_done = threading.Condition(lock)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def serve_control(self) -> None:
        message = bytearray(wire.CTRL_NBYTES)
        while True:
            try:
                await self._ucxx.recv(message, tag=wire.CTRL_TAG)
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad message must not stop every later transfer
                log.exception("ucx: receiving a control message failed")
                await asyncio.sleep(0.01)
                continue
            kind, sender, transfer_id, length = wire.CTRL.unpack_from(message)
            if kind == wire.HELLO:
                route = asyncio.get_running_loop().create_future()
                old = self._senders.get(sender)
                self._senders[sender] = route
                self._spawn(self._accept_sender(sender, length, route, old))
            elif kind == wire.BEGIN:
                header = bytes(message[wire.CTRL.size:wire.CTRL.size + length])  # the buffer is reused
                self._spawn(self._receive(sender, transfer_id, header))
            elif kind == wire.BEGIN_LONG:
                self._spawn(self._receive(sender, transfer_id, length))
            elif kind == wire.VERIFY:
                header = bytes(message[wire.CTRL.size:wire.CTRL.size + length])
                self._spawn(self._answer_verify(sender, transfer_id, header))
            elif kind == wire.VERIFY_LONG:
                self._spawn(self._answer_verify(sender, transfer_id, length))
            else:
                log.warning("ucx: unknown control message kind %d from %x", kind, sender)

    async def _accept_sender(self, sender: int, length: int, route: asyncio.Future,
                             old: asyncio.Future | None) -> None:
        """Make the endpoint that carries acks back to a sender that said HELLO."""
        try:
            address = bytearray(length)
            await asyncio.wait_for(self._ucxx.recv(address, tag=wire.addr_tag(sender)), self._timeout_s)
            ep = await self._ucxx.create_endpoint_from_worker_address(
                self._ucxx.get_ucx_address_from_buffer(bytes(address)),
                endpoint_error_handling=self._error_handling)
        except Exception as exc:
            log.warning("ucx: HELLO from sender %x failed: %s", sender, exc)
            route.set_exception(PeerUnreachable(f"no route back to ucx sender {sender:x}: {exc}"))
            return
        route.set_result(ep)
        if old is not None and old is not route and old.done() and old.exception() is None:
            wire.abort_endpoint(old.result())

    async def _read_header(self, sender: int, request_id: int,
                           header: bytes | int) -> tuple[str, bytes | None, list]:
        """(key, tag, runs) of a request; `header` is the header itself, or its length if it
        follows on the request's DATA tag. A grant that does not parse gives tag None, which
        no page matches."""
        if isinstance(header, int):
            buffer = bytearray(header)
            await self._ucxx.recv(buffer, tag=wire.data_tag(sender, request_id))
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
        if tag is None or dst < 0 or length < 1 or dst + length > self._grants.num_pages:
            return Refusal(dst, max(length, 0), max(length, 0))
        return self._grants.check(dst, length, tag)

    async def _answer_verify(self, sender: int, request_id: int, header: bytes | int) -> None:
        status, refused, first_refused = wire.ACK_OK, 0, 0
        try:
            _key, tag, runs = await self._read_header(sender, request_id, header)
            with self._lock:
                for dst, length in runs:
                    refusal = self._check_run(dst, length, tag)
                    if refusal is not None:
                        first_refused = first_refused if refused else refusal.first_page
                        refused += refusal.count
                        status = wire.ACK_REJECTED
        except Exception as exc:  # a malformed request is refused, never crashes the receiver
            log.warning("ucx: bad grant check %d from %x: %s", request_id, sender, exc)
            status = wire.ACK_REJECTED
        await self._ack(sender, request_id, status, refused, first_refused)

    async def _ack(self, sender: int, request_id: int, status: int, refused: int, first_refused: int) -> None:
        route = self._senders.get(sender)
        if route is None:
            log.warning("ucx: no route back to sender %x for request %d", sender, request_id)
            return
        try:
            ep = await asyncio.wait_for(asyncio.shield(route), self._timeout_s)
            await ep.send(bytearray(wire.ACK.pack(status, refused, request_id, first_refused)),
                          tag=wire.ack_tag(sender, request_id), force_tag=True)
        except Exception as exc:
            log.warning("ucx: ack of request %d to sender %x failed: %s", request_id, sender, exc)

    async def _receive(self, sender: int, transfer_id: int, header: bytes | int) -> None:
        """Receive one transfer; `header` is the header itself, or its length if it follows."""
        tag = wire.data_tag(sender, transfer_id)
        key, run_tag, runs = await self._read_header(sender, transfer_id, header)
        page_nbytes = self._page_nbytes
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
        end = bytearray(wire.END.size)
        receives = [asyncio.ensure_future(self._receive_run(key, target, scratch, tag)) for target in targets]
        end_receive = asyncio.ensure_future(self._ucxx.recv(end, tag=tag))
        await asyncio.gather(*receives, return_exceptions=True)
        await end_receive
        kind, aborted, _ = wire.END.unpack(end)
        if kind != wire.END_KIND:
            log.warning("ucx: transfer %d from %x ended without END", transfer_id, sender)
        if aborted:
            status = wire.ACK_ABORTED
        else:
            status = wire.ACK_OK if in_pool == len(targets) else wire.ACK_REJECTED
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

    def release(self, key: str) -> None:
        """Return once no receive into the key's pages is still posted (bounded by timeout_s).
        Receives already posted complete with the sender's bytes, or with an empty message if it
        aborts: wait for them (bounded, in case the sender died) so that nothing lands after."""
        deadline = time.monotonic() + self._timeout_s
        with self._inflight_done:
            while self._inflight.get(key) and time.monotonic() < deadline:
                self._inflight_done.wait(timeout=0.05)
            if self._inflight.get(key):
                log.warning("ucx: receives for %r still posted after %.1f s (sender dead?)", key,
                            self._timeout_s)

    async def close(self) -> None:
        """Stop every receive and drop the routes back to senders (on the loop, at shutdown)."""
        for task in list(self._background):
            task.cancel()
        for route in self._senders.values():
            if route.done() and not route.cancelled() and route.exception() is None:
                wire.abort_endpoint(route.result())
        self._senders.clear()
