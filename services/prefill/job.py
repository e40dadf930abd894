"""Prefill's side of PD for one request: handshake, grant, run, writes, cleanup.

`PrefillJobs.run` drives one room through the prefill's stages (services/worker/rooms.py; their
queue labels are SGLang's: `bootstrap`, `waiting`, `inflight`) for the prefill servicer:
  handshake  connect to the decode worker's transfer endpoint (cached per peer); refuse a different
             KV layout or transfer backend, naming both values (FAILED_PRECONDITION); check the
             destination pages against the prompt (INVALID_ARGUMENT), then through the transfer
             engine that decode reserved exactly `dst_page_ids` for this room and grant
             (PERMISSION_DENIED otherwise: a forged or stale call writes nothing)
  waiting    the engine runs the prompt in chunks (a prefill-only request, from its prefix cache
             where it can); after each chunk its completed pages are written straight into decode's
             reserved pages (writes.py), so the transfer overlaps the compute. The first
             `skip_pages` pages, which decode already holds in its own prefix cache, are not written.
  inflight   after the last chunk (and its partial page), wait until every write has landed;
             the first token is then decode's completion signal.
The engine holds the prompt's pages until the writes are finished or aborted, then frees them
(`_cleanup`); every way out of `run`, a cancellation included, goes through it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import grpc

from engine.outputs import RequestAborted, TokenOutput
from engine.request import EngineRequest
from libkv.layout import LayoutMismatch
from libkv.transfer import (
    BackendMismatch,
    GrantRefused,
    PeerId,
    PeerUnreachable,
    TransferBackend,
    TransferError,
)
from protos.v1 import worker_pb2
from services.prefill.room import PrefillRoom
from services.prefill.writes import RoomWrites, TransferQueues
from services.worker.metrics import HANDSHAKE
from services.worker.rooms import RoomTable, Stage, finish_despite_cancel
from services.worker.runtime import WorkerRuntime
from services.worker.wire import BadRequest, Refused, endpoint_from_proto

log = logging.getLogger("pdserve.prefill")

# Fetches a --language-only worker's image embeddings (RoleServicer.with_embeddings).
Embed = Callable[[EngineRequest, list[bytes | memoryview]], Awaitable[EngineRequest]]


@dataclass(frozen=True)
class PrefillDone:
    """A finished job: the first token, the writes that carried the prompt's KV, and how long they
    took from the first write."""

    first: TokenOutput
    writes: RoomWrites
    transfer_seconds: float


class PrefillJobs:
    """The prefill worker's jobs (see the module docstring). One per prefill worker; its servicer
    calls `run` for every Prefill call."""

    def __init__(self, runtime: WorkerRuntime, rooms: RoomTable[PrefillRoom]) -> None:
        if runtime.backend is None:
            raise ValueError("a prefill worker needs a transfer backend")
        self.engine = runtime.engine
        self.config = runtime.config
        self.metrics = runtime.metrics
        self.backend: TransferBackend = runtime.backend
        self.rooms = rooms
        self.transfer_queues = TransferQueues(self.config.transfer_queue_size,
                                              self.config.transfer_thread_pool_size)

    async def run(self, room: PrefillRoom, request: worker_pb2.PrefillRequest, parsed: EngineRequest,
                  embed: Embed, arrival: float) -> PrefillDone:
        """Handshake, run and write the room's prompt (see the module docstring). Raises Refused when
        it cannot be done; its pages are free again by then (a cancellation: also re-raised)."""
        writes = None
        try:
            peer = await self._connect(request)  # refuses another layout or backend
            writes = room.writes = RoomWrites(room.id, self.backend, self.transfer_queues, peer,
                                              list(request.dst_page_ids), grant=request.grant,
                                              want_checksums=request.page_checksums,
                                              skip_pages=max(request.skip_pages, 0))
            # after the handshake: with another page size the page count says nothing
            check_destination(request, len(parsed.prompt_ids), self.engine.pages.page_size)
            await self._check_grant(writes, request)
            parsed = await embed(parsed, list(request.images))  # --language-only (EPD)
            room.stage = Stage.WAITING
            first = await self._first_token(replace(parsed, on_pages_filled=writes.push))
            room.stage = Stage.INFLIGHT
            await asyncio.wait_for(writes.wait_all(), timeout=self.config.transfer_timeout)
        except GrantRefused as exc:  # two-sided engines: the receiver refused a write itself
            self.metrics.failure("grant")
            await self._cleanup(room, writes, aborted=True)
            raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                          f"room {room.id}: decode refused the KV write: {exc}") from None
        except (TransferError, asyncio.TimeoutError) as exc:  # TimeoutError itself only from Python 3.11 on
            self.metrics.failure("transfer")
            await self._cleanup(room, writes, aborted=True)
            raise Refused(grpc.StatusCode.UNAVAILABLE,
                          f"room {room.id}: KV transfer to decode failed: {exc}") from None
        except BaseException:  # refused, aborted, cancelled (decode gone), engine error
            await self._cleanup(room, writes, aborted=True)
            raise
        await self._cleanup(room, writes, aborted=False)
        assert writes is not None  # the try above made it
        elapsed = time.perf_counter() - (writes.first_write_at or arrival)
        self.metrics.prompt_tokens.inc(first.prompt_tokens)
        self.metrics.ttft.observe(time.perf_counter() - arrival)
        self.metrics.transfer_latency.observe(elapsed)
        self.metrics.transfer_bytes.inc(writes.bytes_pushed)
        if elapsed > 0:
            self.metrics.transfer_speed.observe(writes.bytes_pushed / elapsed / 1e9)
        return PrefillDone(first, writes, elapsed)

    async def _first_token(self, request: EngineRequest) -> TokenOutput:
        """Run the prompt; its first token is the prefill-only request's one output. The prompt's
        pages stay held under the room until `_cleanup`. RequestAborted if the engine aborted it."""
        first = None
        async for batch in self.engine.generate(request):
            first = batch[-1]
        if first is None or first.finish_reason == "abort":
            raise RequestAborted(f"prefill of room {request.room!r} was aborted")
        return first

    async def _connect(self, request: worker_pb2.PrefillRequest) -> PeerId:
        try:
            endpoint = endpoint_from_proto(request.dst)
            return await asyncio.to_thread(self.backend.connect, endpoint)
        except (LayoutMismatch, BackendMismatch) as exc:
            self.metrics.failure(HANDSHAKE)
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"room {request.room}: decode worker {request.decode_worker_id or '?'} "
                          f"cannot take our KV: {exc}") from None
        except (ValueError, TransferError) as exc:
            self.metrics.failure(HANDSHAKE)
            raise Refused(grpc.StatusCode.UNAVAILABLE,
                          f"room {request.room}: cannot reach decode's transfer endpoint: {exc}") from None

    async def _check_grant(self, writes: RoomWrites, request: worker_pb2.PrefillRequest) -> None:
        """Decode must have reserved exactly these pages for this room and request: read through
        the transfer engine (the same endpoint the writes go to), so a forged or stale call that
        names pages of other rooms is refused before anything is computed or written.

        The connection is usually one kept from earlier requests. If the engine reports that peer
        unreachable (after a network cut NIXL keeps a connection marked broken even when the peer
        is back), the backend drops it and one fresh connection is tried before the request fails:
        a stale connection is this worker's state, not the client's problem."""
        for attempt in (1, 2):
            try:
                await asyncio.to_thread(self.backend.verify_grant, writes.peer, writes.dst_page_ids,
                                        key=writes.room, grant=writes.grant)
                return
            except GrantRefused as exc:
                self.metrics.failure("grant")
                log.warning("room %s: refused: %s", writes.room, exc)
                raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                              f"room {writes.room}: decode did not reserve these pages for this room: "
                              f"{exc}") from None
            except PeerUnreachable as exc:
                if attempt == 1:
                    stale = writes.peer
                    await asyncio.to_thread(self.backend.disconnect, stale)  # never handed out again
                    writes.peer = await self._connect(request)
                    log.warning("room %s: %s; reconnected (%s -> %s)", writes.room, exc, stale, writes.peer)
                    continue
                self.metrics.failure(HANDSHAKE)
                raise Refused(grpc.StatusCode.UNAVAILABLE,
                              f"room {writes.room}: cannot check decode's reservation: {exc}") from None
            except TransferError as exc:
                self.metrics.failure(HANDSHAKE)
                raise Refused(grpc.StatusCode.UNAVAILABLE,
                              f"room {writes.room}: cannot check decode's reservation: {exc}") from None

    async def _cleanup(self, room: PrefillRoom, writes: RoomWrites | None, *, aborted: bool) -> None:
        """Free the room's pages, after stopping its writes (waiting until none can land) if aborted.

        On abort the engine stops the request between steps, so a forward pass still using the
        pages is never raced, and keeps them held under the room (a prefill-only request with a
        transfer hook): a queued or running write may still read them, and a page freed and
        recomputed for another prompt under it would send that prompt's KV with this one's
        checksum. They are freed here once no write of the room is left. Runs to the end even
        when the handler is cancelled again meanwhile (decode's Abort arriving while the cancelled
        call is still being cleaned up), then re-raises that cancellation.
        """
        room.closing = True
        await finish_despite_cancel(self._stop_and_free(room, writes, aborted))

    async def _stop_and_free(self, room: PrefillRoom, writes: RoomWrites | None, aborted: bool) -> None:
        try:
            if aborted:
                try:
                    if writes is not None:  # None: refused in the handshake, before any write
                        await asyncio.to_thread(writes.abort_all)
                finally:  # the engine holds the pages until told: never leave them held
                    self.engine.abort(room.id)
            else:
                self.engine.release(room.id)
        finally:  # remembered: an Abort after this (decode gave up on the call) learns what may be landing
            self.rooms.close(room)

    def close(self) -> None:
        self.transfer_queues.shutdown()


def check_destination(request: worker_pb2.PrefillRequest, num_tokens: int, page_size: int) -> None:
    """`skip_pages` must name only full pages of the prompt; the destination pages must be as many
    as the rest of the prompt needs, distinct, and inside decode's pool. A forged skip count cannot
    make prefill write anything but the pages decode reserved for this room (the grant check
    comes next), and cannot move a page to another position: it is refused here (BadRequest)."""
    skip, full = request.skip_pages, num_tokens // page_size
    if not 0 <= skip <= full:
        raise BadRequest(f"skip_pages: {skip} is not between 0 and the prompt's {full} full pages "
                         f"({num_tokens} tokens, pages of {page_size})")
    needed = -(-num_tokens // page_size) - skip
    pages = request.dst_page_ids
    if len(pages) != needed:
        raise BadRequest(f"dst_page_ids: {len(pages)} destination pages for a prompt that needs {needed}"
                         + (f" after {skip} skipped pages" if skip else ""))
    if not request.HasField("dst"):
        raise BadRequest("dst: decode's transfer endpoint is required")
    bad = [p for p in pages if not 0 <= p < request.dst.num_pages]
    if bad:
        raise BadRequest(f"dst_page_ids: pages {bad[:8]} are outside decode's pool of "
                         f"{request.dst.num_pages} pages")
    if len(set(pages)) != len(pages):
        raise BadRequest("dst_page_ids: a destination page is named twice")
