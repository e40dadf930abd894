"""The prefill worker: pdserve.v1.Prefill (`--disaggregation-mode prefill`), called by decode workers.

One request moves through the prefill's stages (services/worker/rooms.py; their queue labels are
SGLang's: `bootstrap`, `waiting`, `inflight`):
  handshake  connect to the decode worker's transfer endpoint (cached per peer); refuse a different
             model, KV layout or transfer backend, naming both values (FAILED_PRECONDITION); check
             through the transfer engine that decode reserved exactly `dst_page_ids` for this
             room and grant (PERMISSION_DENIED otherwise: a forged or stale call writes nothing)
  waiting    the engine runs the prompt in chunks (a prefill-only request, from its prefix cache
             where it can); after each chunk its completed pages are written straight into decode's
             reserved pages (writes.py), so the transfer overlaps the compute. The first
             `skip_pages` pages, which decode already holds in its own prefix cache, are not written.
  inflight   after the last chunk (and its partial page), wait until every write has landed,
             then reply with the first token: that reply is decode's completion signal.
The engine holds the prompt's pages until the writes are finished or aborted, then frees them.

Images (a vision-language model): the call carries the encoded images and the prompt before
expansion; they are decoded and the prompt expanded here as decode did (services/worker/wire.py),
and the vision tower runs with the prompt's first chunk. Images that disagree with the prompt's
image-pad tokens (none sent for pads, more than the pads) are refused before anything is held.

Abort (decode gone, client gone, decode's explicit Abort RPC): stop the engine work, abort every
write and wait until none can land, then free. `Abort` answers only after that, and the room
table remembers the room so a Prefill that arrives after its own Abort is refused rather than
writing into pages decode has already reused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

import grpc

from engine.outputs import RequestAborted, TokenOutput
from engine.request import EngineRequest
from libkv.layout import LayoutMismatch
from libkv.transfer import BackendMismatch, GrantRefused, PeerUnreachable, TransferError
from protos.v1 import worker_pb2, worker_pb2_grpc
from services.prefill.writes import RoomWrites, TransferQueues
from services.worker.metrics import HANDSHAKE
from services.worker.role_servicer import RoleServicer
from services.worker.rooms import Room, RoomInUse, Stage, finish_despite_cancel
from services.worker.runtime import WorkerRuntime
from services.worker.wire import BadRequest, endpoint_from_proto, parse_request, token_to_proto

log = logging.getLogger("pdserve.prefill")


class PrefillServicer(RoleServicer, worker_pb2_grpc.PrefillServicer):
    """pdserve.v1.Prefill over the engine's prefill-only requests and the transfer backend."""

    def __init__(self, runtime: WorkerRuntime) -> None:
        assert runtime.backend is not None
        super().__init__(runtime)
        self.backend = runtime.backend
        self.transfer_queues = TransferQueues(self.config.transfer_queue_size,
                                              self.config.transfer_thread_pool_size)

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        arrival = time.perf_counter()
        try:
            if request.images:  # decoding and resizing images: off the event loop
                parsed = await asyncio.to_thread(parse_request, self.engine, request.room, request.prompt_token_ids,
                                                 request.sampling, prefill_only=True, images=list(request.images))
            else:
                parsed = parse_request(self.engine, request.room, request.prompt_token_ids, request.sampling,
                                       prefill_only=True)
            if not request.room:
                raise BadRequest("room is required")
            if request.model != self.model_name:
                raise _Refused(f"model mismatch (prefill vs decode): {self.model_name!r} vs {request.model!r}")
        except _Refused as exc:
            self.metrics.failure(HANDSHAKE)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:  # opened before the handshake, so an Abort that arrives during it finds the room
            room = self.rooms.open(request.room, Stage.HANDSHAKE, asyncio.current_task())
        except RoomInUse:
            await context.abort(grpc.StatusCode.ABORTED, f"room {request.room} was aborted or is already running")
        writes = room.writes = RoomWrites(request.room, self.backend, self.transfer_queues,
                                          list(request.dst_page_ids), grant=request.grant,
                                          want_checksums=request.page_checksums, skip_pages=max(request.skip_pages, 0))
        try:
            writes.peer = await self._connect(request, context)  # refuses another layout or backend
            try:  # after the handshake: with another page size the page count says nothing
                _check_destination(request, len(parsed.prompt_ids), self.engine.pages.page_size)
            except BadRequest as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            await self._check_grant(writes, request, context)
            parsed = await self.with_embeddings(parsed, list(request.images), context)  # --language-only (EPD)
            room.stage = Stage.WAITING
            first = await self._first_token(replace(parsed, on_pages_filled=writes.push))
            room.stage = Stage.INFLIGHT
            await asyncio.wait_for(writes.wait_all(), timeout=self.config.transfer_timeout)
        except GrantRefused as exc:  # two-sided engines: the receiver refused a write itself
            self.metrics.failure("grant")
            await self._cleanup(room, aborted=True)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"room {room.id}: decode refused the KV write: {exc}")
        except (TransferError, TimeoutError) as exc:
            self.metrics.failure("transfer")
            await self._cleanup(room, aborted=True)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"room {room.id}: KV transfer to decode failed: {exc}")
        except BaseException:  # aborted, cancelled (decode gone), refused handshake, engine error
            await self._cleanup(room, aborted=True)
            raise
        await self._cleanup(room, aborted=False)
        elapsed = time.perf_counter() - (writes.first_write_at or arrival)
        self.metrics.prompt_tokens.inc(first.prompt_tokens)
        self.metrics.ttft.observe(time.perf_counter() - arrival)
        self.metrics.transfer_latency.observe(elapsed)
        self.metrics.transfer_bytes.inc(writes.bytes_pushed)
        if elapsed > 0:
            self.metrics.transfer_speed.observe(writes.bytes_pushed / elapsed / 1e9)
        return worker_pb2.PrefillResponse(
            first_token=token_to_proto(first.token_id, "", first.logprob, first.top_logprobs),
            num_pages_written=writes.pages_pushed, bytes_transferred=writes.bytes_pushed,
            transfer_seconds=elapsed, page_checksums=writes.checksums, tp_size=self.config.engine.topology().attn_tp_size,
            num_pages_skipped=writes.skip_pages)

    async def _first_token(self, request: EngineRequest) -> TokenOutput:
        """Run the prompt; its first token is the prefill-only request's one output. The prompt's
        pages stay held under the room until `_cleanup`. RequestAborted if the engine aborted it."""
        first = None
        async for batch in self.engine.generate(request):
            first = batch[-1]
        if first is None or first.finish_reason == "abort":
            raise RequestAborted(f"prefill of room {request.room!r} was aborted")
        return first

    async def _connect(self, request: worker_pb2.PrefillRequest, context):
        try:
            endpoint = endpoint_from_proto(request.dst)
            return await asyncio.to_thread(self.backend.connect, endpoint)
        except (LayoutMismatch, BackendMismatch) as exc:
            self.metrics.failure(HANDSHAKE)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"room {request.room}: decode worker {request.decode_worker_id or '?'} "
                                f"cannot take our KV: {exc}")
        except (ValueError, TransferError) as exc:
            self.metrics.failure(HANDSHAKE)
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"room {request.room}: cannot reach decode's transfer endpoint: {exc}")

    async def _check_grant(self, writes: RoomWrites, request: worker_pb2.PrefillRequest, context) -> None:
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
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    f"room {writes.room}: decode did not reserve these pages for this room: {exc}")
            except PeerUnreachable as exc:
                if attempt == 1:
                    stale = writes.peer
                    await asyncio.to_thread(self.backend.disconnect, stale)  # never handed out again
                    writes.peer = await self._connect(request, context)
                    log.warning("room %s: %s; reconnected (%s -> %s)", writes.room, exc, stale, writes.peer)
                    continue
                self.metrics.failure(HANDSHAKE)
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    f"room {writes.room}: cannot check decode's reservation: {exc}")
            except TransferError as exc:
                self.metrics.failure(HANDSHAKE)
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    f"room {writes.room}: cannot check decode's reservation: {exc}")

    async def _cleanup(self, room: Room, *, aborted: bool) -> None:
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
        await finish_despite_cancel(self._stop_and_free(room, aborted))

    async def _stop_and_free(self, room: Room, aborted: bool) -> None:
        writes: RoomWrites = room.writes
        try:
            if aborted:
                try:
                    await asyncio.to_thread(writes.abort_all)
                finally:  # the engine holds the pages until told: never leave them held
                    self.engine.abort(room.id)
            else:
                self.engine.release(room.id)
        finally:  # remembered: an Abort after this (decode gave up on the call) learns what may be landing
            self.rooms.close(room, list(writes.checksums))

    async def Abort(self, request: worker_pb2.AbortRequest, context) -> worker_pb2.AbortResponse:
        room = self.rooms.name_in_abort(request.room)  # a Prefill of it from now on is refused
        if room.stage is Stage.DONE:  # finished, or already stopped (decode cancelling the call comes first)
            return worker_pb2.AbortResponse(found=False, page_checksums=room.checksums, tp_size=self.config.engine.topology().attn_tp_size)
        if room.task is not None and not room.closing:
            room.task.cancel()
        await asyncio.shield(room.ended.wait())
        return worker_pb2.AbortResponse(found=True, page_checksums=room.writes.checksums, tp_size=self.config.engine.topology().attn_tp_size)


def _check_destination(request: worker_pb2.PrefillRequest, num_tokens: int, page_size: int) -> None:
    """`skip_pages` must name only full pages of the prompt; the destination pages must be as many
    as the rest of the prompt needs, distinct, and inside decode's pool. A forged skip count cannot
    make prefill write anything but the pages decode reserved for this room (the grant check
    comes next), and cannot move a page to another position: it is refused here."""
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
        raise BadRequest(f"dst_page_ids: pages {bad[:8]} are outside decode's pool of {request.dst.num_pages} pages")
    if len(set(pages)) != len(pages):
        raise BadRequest("dst_page_ids: a destination page is named twice")


class _Refused(ValueError):
    """The decode side and this prefill disagree on something fixed (model, layout, backend)."""
