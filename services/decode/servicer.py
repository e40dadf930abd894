"""The decode worker: pdserve.v1.Worker driving a remote prefill (`--disaggregation-mode decode`).

One request, through its stages in the room table (services/worker/rooms.py):
  prealloc  wait (FIFO, `PreallocQueue`) until the engine can reserve pages for the prompt; its
            leading full pages come from this worker's prefix cache when they are there
            (decode-side reuse)
  transfer  call Prefill(room, prompt, dst pages, skip_pages, our endpoint) on the prefill worker
            the gateway chose; it runs the prompt and writes the KV of the pages after the
            `skip_pages` cached ones into the reserved pages, then replies with the first token.
            The reply is the completion signal: pages are never read before it, and not before
            they hash to what prefill sent (landing).
  running   the engine takes the reserved pages and the first token into its running batch (a
            prefilled request: the engine's own `waiting` and `running` queues count it from
            here); tokens stream back in batches, as a colocated worker's do.

Images (a vision-language model): decoded here off the event loop; the reservation's page hashes
carry their digests, the Prefill call forwards them encoded, and the prefilled request keeps them
for its M-RoPE positions (the vision tower runs here only to recompute after a retraction).

Conditional disaggregation (`--conditional-disaggregation`; its settings are
services/worker/config.py's LocalPrefillRule, the decision is `local_prefill_reason` below): a
short prompt, a request with no prefill worker, or one whose prefill is busy runs here instead, as
on a colocated worker (the engine's own waiting -> running queues), with the same output.

Failure: if the Prefill call fails, is cancelled, times out, or the prefill's registry lease
expires (it froze or was cut off), decode answers UNAVAILABLE at once (the gateway may retry on
another pair) and hands the reserved pages to the quarantine (quarantine.py), which frees them
once no write of the room can still land. Cancelling Generate (client gone) takes the same path.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import replace

import grpc

from engine.engine import Engine
from engine.multimodal.inputs import ImageInput
from engine.outputs import FirstToken
from engine.page_manager import Reservation
from engine.request import EngineRequest
from libkv.landing import wait_landed
from libkv.transfer.dp_groups import DPGroupsBackend
from pdserve import envs
from protos.v1 import bootstrap_pb2, common_pb2, worker_pb2, worker_pb2_grpc
from services.common.registry_client import RegistryClient
from services.decode.prefill_client import PrefillClients, PrefillFailed
from services.decode.quarantine import PageQuarantine
from services.worker.config import LocalPrefillRule
from services.worker.role_servicer import RoleServicer
from services.worker.rooms import Room, RoomInUse, Stage, finish_despite_cancel
from services.worker.runtime import WorkerRuntime
from services.worker.wire import BadRequest, endpoint_to_proto, parse_request, relay

log = logging.getLogger("pdserve.decode")

# Trailing metadata naming the worker that caused a failure (here: the prefill), so the gateway
# blames and retries around the right worker without parsing messages.
FAILED_PEER_KEY = "pdserve-failed-peer"
_POLL_S = 0.005

# Why a decode worker runs a prompt itself (conditional disaggregation). Shipping a prompt to a
# prefill worker costs a Prefill round trip, a handshake, page reservations and a KV transfer; for a
# short prompt that costs more than the forward pass it saves the decode batch, and when no prefill
# worker can take it the request would otherwise fail. The local run batches the prompt's chunks
# with the running decode batch like a colocated worker, and its output is the same: both paths run
# the same chunked prefill over the same weights, and sampling is seeded per token, not per worker.
# `pdserve:local_prefill_requests_total{reason}` counts each reason.
NO_PREFILL = "no_prefill"  # the request names no prefill worker (none was healthy at the gateway)
SHORT_PROMPT = "short_prompt"  # at most --local-prefill-max-tokens prompt tokens
PREFILL_QUEUE = "prefill_queue"  # --local-prefill-max-prefill-queue calls already open on that prefill
REASONS = (NO_PREFILL, SHORT_PROMPT, PREFILL_QUEUE)


def local_prefill_reason(rule: LocalPrefillRule, prompt_tokens: int, prefill_address: str,
                         open_on_prefill: int) -> str | None:
    """Why this request runs here (the first of REASONS that applies, in that order), or None: ship
    it to `prefill_address`. `open_on_prefill`: Prefill calls this worker has open on that prefill."""
    if not rule.enabled:
        return None
    if not prefill_address:
        return NO_PREFILL
    if prompt_tokens <= rule.max_tokens:
        return SHORT_PROMPT
    if rule.max_prefill_queue and open_on_prefill >= rule.max_prefill_queue:
        return PREFILL_QUEUE
    return None


class PreallocTimeout(TimeoutError):
    """No pages became free within the waiting timeout."""


class PreallocQueue:
    """The `prealloc` stage: first come, first served page reservation.

    Only the head of the queue polls the engine for pages, so a large prompt at the head is not
    starved by small ones behind it (they wait their turn). `asyncio.Lock` wakes waiters in FIFO
    order. Pages are freed by the engine thread; polling every few ms is cheaper than wiring a
    cross-thread notification for a queue that is empty almost always.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._turn = asyncio.Lock()

    async def reserve(self, room: str, prompt_ids: list[int], timeout_s: float,
                      images: Sequence[ImageInput] = ()) -> Reservation:
        """Pages for the prompt under `room`, its leading full pages from the prefix cache when
        there (those need no transfer: `Reservation.tail` is what prefill must write). `images`
        salt the page hashes, as the prefill's scheduler salts them."""
        num_tokens = len(prompt_ids)
        deadline = time.monotonic() + timeout_s
        try:
            await asyncio.wait_for(self._turn.acquire(), timeout=timeout_s)
        except TimeoutError:
            raise PreallocTimeout(f"no KV pages for {num_tokens} tokens within {timeout_s:.0f}s") from None
        try:
            hashes = self.engine.prompt_hashes(prompt_ids, images)  # once, not at every poll
            while True:
                reservation = self.engine.reserve_prompt(room, prompt_ids, hashes)
                if reservation is not None:
                    return reservation
                if time.monotonic() >= deadline:
                    raise PreallocTimeout(f"no KV pages for {num_tokens} tokens within {timeout_s:.0f}s")
                await asyncio.sleep(_POLL_S)
        finally:
            self._turn.release()


class DecodeServicer(RoleServicer, worker_pb2_grpc.WorkerServicer):
    """pdserve.v1.Worker for a decode worker. Called by the gateway; calls prefill workers."""

    def __init__(self, runtime: WorkerRuntime) -> None:
        assert runtime.backend is not None
        super().__init__(runtime)
        self.backend = runtime.backend
        self.prealloc = PreallocQueue(self.engine)
        # An Abort waits until the prefill stopped every write, which is bounded by one write's timeout.
        self.prefills = PrefillClients(abort_timeout_s=self.config.transfer_timeout + 5.0,
                                       security=self.config.security)
        self.quarantine = PageQuarantine(self.engine, self.backend, self.prefills, self.rooms,
                                         give_up_s=self.config.quarantine_timeout)
        runtime.metrics.gauge("kv_quarantined_rooms", "Failed requests whose pages wait for their prefill "
                              "to confirm that no KV write can still land",
                              lambda: len(self.rooms.rooms(Stage.QUARANTINED)))
        # A one-sided write's "done" does not say it landed; the checksums do (libkv.landing), so
        # they are always on there: --no-kv-checksum only spares two-sided engines the hashing.
        self._checksums = self.backend.moves_bytes and (self.config.kv_checksum or self.backend.one_sided)
        self._endpoint = endpoint_to_proto(runtime.backend.endpoint())
        self._dp_groups = isinstance(runtime.backend, DPGroupsBackend)
        self.local_prefill = self.config.local_prefill_rule()
        # A prefill's identity is its registry worker id, not its address: a process restarted on the
        # same port is a new worker. The id registered at each address (from watch_prefills), and the
        # id a room's Prefill call went to ("" when the registry had not told yet).
        self._prefill_ids: dict[str, str] = {}
        self._call_prefill_ids: dict[str, str] = {}
        self._hold_admission = envs.TEST_HOLD_ADMISSION.get()

    def _open_on(self, prefill_address: str) -> int:
        """Prefill calls this worker has open on `prefill_address` (its queue, as far as we load it)."""
        return sum(1 for room in self.rooms.rooms() if room.call is not None and room.prefill_address == prefill_address)

    async def Generate(self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        arrival = time.perf_counter()
        try:
            if request.images:  # decoding and resizing images: off the event loop
                parsed = await asyncio.to_thread(parse_request, self.engine, request.room, request.prompt_token_ids,
                                                 request.sampling, images=list(request.images))
            else:
                parsed = parse_request(self.engine, request.room, request.prompt_token_ids, request.sampling)
            prefill_address = request.prefill_address if request.HasField("prefill_address") else ""
            if not prefill_address and not self.local_prefill.enabled:
                raise BadRequest("a decode worker needs prefill_address: the prefill worker to run the prompt on "
                                 "(or --conditional-disaggregation to run it here)")
        except ValueError as exc:
            await context.abort(BadRequest.code, str(exc))
        try:
            room = self.rooms.open(parsed.room, Stage.PREALLOC, asyncio.current_task())
        except RoomInUse:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"room {parsed.room} is already in use on this worker")
        try:
            local = local_prefill_reason(self.local_prefill, len(parsed.prompt_ids), prefill_address,
                                         self._open_on(prefill_address))
            if local is not None:
                room.stage, room.local = Stage.RUNNING, True
                self.runtime.metrics.local_prefill(local)
                log.debug("room %s: prefill runs on this decode worker (%s, %d prompt tokens)", room.id, local,
                          len(parsed.prompt_ids))
            else:
                first = await self._prefill_remotely(room, parsed, request, prefill_address, context)
                await self._before_admission(room)
                parsed = replace(parsed, first_token=first)  # the reserved pages become the request's
                room.stage, room.reservation = Stage.RUNNING, None
            async for response in relay(self.engine.generate(parsed), self.runtime.metrics, arrival):
                yield response
        except asyncio.CancelledError:
            if not room.aborted or context.done():
                raise  # the caller left (the gateway cancels, then aborts) or the server stops: nobody to answer
            # Our Abort cancelled the handler; its caller still reads the stream. End it as a colocated
            # worker ends an aborted request (finish reason abort), not by leaving it open until the
            # caller's deadline. The cleanup above (quarantine, released pages) has run already.
            yield worker_pb2.GenerateResponse(
                finish_reason=common_pb2.FINISH_REASON_ABORT,
                usage=worker_pb2.Usage(prompt_tokens=len(parsed.prompt_ids), completion_tokens=0))
        finally:
            if room.stage is not Stage.QUARANTINED:
                self.rooms.close(room)

    async def _prefill_remotely(self, room: Room, parsed: EngineRequest, request: worker_pb2.GenerateRequest,
                                prefill_address: str, context: grpc.aio.ServicerContext) -> FirstToken:
        """prealloc + transfer. Returns the first token with the prompt's KV in the reserved pages.

        A request with images reserves pages for its expanded prompt, hashed with its images'
        digests (so its prefix-cache hits are exact), and forwards the encoded images with the
        prompt as the client sent it: the prefill expands it to the same tokens and runs the
        vision tower. This worker never does (unless a retraction makes it recompute)."""
        try:
            room.reservation = await self.prealloc.reserve(room.id, parsed.prompt_ids, self.config.waiting_timeout,
                                                           parsed.images)
        except PreallocTimeout as exc:
            self.runtime.metrics.failure("prealloc")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"room {room.id}: {exc}")
        room.stage = Stage.TRANSFER
        # Only the pages after the ones reused from our prefix cache are offered to the prefill:
        # the cached ones are shared with other requests and must never be written.
        pages = room.reservation.tail
        if self._checksums and self.backend.one_sided:
            # The landing check takes matching bytes as proof of arrival; a page that held this
            # same prompt before would match before the write lands (KVPool.poison). Inline, not
            # in a thread: no await between reserving and the try below that frees on failure.
            self.engine.pool_for(room.id).poison(pages)
        # Binds the pages to this room and request: the prefill checks the binding through the
        # transfer engine before it writes (two-sided engines also check every write), so only the
        # prefill given this grant can fill them.
        grant = secrets.token_bytes(16)
        self.backend.expect(room.id, pages, grant=grant)
        prefill_request = worker_pb2.PrefillRequest(  # the sampling message as the client sent it
            room=room.id, prompt_token_ids=request.prompt_token_ids if request.images else parsed.prompt_ids,
            images=request.images, sampling=request.sampling, dst_page_ids=pages,
            dst=self._endpoint_for(room.id), decode_worker_id=self.runtime.registry.worker_id if self.runtime.registry else "",
            model=self.model_name, grant=grant, page_checksums=self._checksums,
            skip_pages=room.reservation.cached_pages)
        room.prefill_address = prefill_address
        self._call_prefill_ids[room.id] = self._prefill_ids.get(prefill_address, "")
        call = room.call = asyncio.ensure_future(self.prefills.prefill(
            prefill_address, prefill_request, parsed.params,
            timeout_s=self.config.bootstrap_timeout + self.config.waiting_timeout))
        try:
            await asyncio.wait({call})  # not `await call`: a watcher cancelling the call is a failure, not ours
            if call.cancelled():
                raise PrefillFailed(f"prefill {prefill_address} {room.lost or 'was lost'}",
                                    grpc.StatusCode.UNAVAILABLE, "prefill")
            reply = call.result()
        except PrefillFailed as exc:
            self.runtime.metrics.failure(exc.stage)
            self.quarantine.hold(room, pages)
            log.warning("room %s: %s", room.id, exc)
            await context.abort(exc.code, f"room {room.id}: {exc}",
                                trailing_metadata=((FAILED_PEER_KEY, prefill_address),))
        except BaseException:  # cancelled (client gone, shutdown): stop prefill, free pages when safe
            call.cancel()
            self.quarantine.hold(room, pages)
            raise
        finally:
            room.call, room.lost = None, ""
            self._call_prefill_ids.pop(room.id, None)
        self.backend.release_expectation(room.id)
        if self._checksums:
            await self._check_arrived(room.id, pages, reply.page_checksums, prefill_address, context, reply.tp_size)
        if room.reservation.cached_pages:
            # In the units of the prefill's kv_transfer_bytes_total: every rank of this worker gets
            # its own pages (its KV heads; MLA: the whole latent), so a page ships tp_size rank pages
            # of every layer (under pipeline parallelism each stage's ranks hold their layers' part).
            layout = self.engine.kv_layout
            shipped_page_nbytes = (layout.page_nbytes // layout.num_layers * self.engine.model_config.num_layers
                                   * self.config.engine.topology().attn_tp_size)
            self.runtime.metrics.transfer_bytes_saved.inc(room.reservation.cached_pages * shipped_page_nbytes)
        return reply.first

    async def _before_admission(self, room: Room) -> None:
        """The window between "the room's KV landed" (prefill is done with it) and "the engine took the
        room into its batch" (engine.generate, with no await before it hands the request over). The
        reserved pages are the engine's reservation until then, which no abort path frees (the engine
        does not know the request yet, and the quarantine is only for pages a write may still reach):
        a request cancelled here frees them itself. Only a test holds a request here
        (PDSERVE_TEST_HOLD_ADMISSION), so that its abort lands in the window by construction."""
        if not (self._hold_admission and room.id.startswith(self._hold_admission)):
            return
        log.info("room %s: held before admission (PDSERVE_TEST_HOLD_ADMISSION) until aborted", room.id)
        try:
            await asyncio.Event().wait()  # until cancelled: an Abort, the client gone, shutdown
        except BaseException:
            self.engine.release(room.id)
            raise

    def _endpoint_for(self, room: str) -> common_pb2.TransferEndpoint:
        """Where the prefill writes the room's pages: under DP attention, its group's ranks."""
        if not self._dp_groups:
            return self._endpoint
        return endpoint_to_proto(self.backend.endpoint_for(room))

    async def _check_arrived(self, room: str, pages: list[int], sent: list[int], prefill_address: str,
                             context: grpc.aio.ServicerContext, sender_tp_size: int = 1) -> None:
        """Wait until the pages hold what prefill sent (libkv.landing: the writes may still be on
        their way), bounded; pages that still differ then fail the request (retryable on another
        pair) before it joins the batch. The wait finishes even if the request is cancelled
        meanwhile, so pages are never freed while bytes for them may still land."""
        if len(sent) != len(pages):
            bad, problem = pages, f"{len(sent)} checksums for {len(pages)} pages"
        else:
            try:
                bad = await finish_despite_cancel(wait_landed(self.engine.pool_for(room), pages, sent,
                                                              sender_tp_size=sender_tp_size))
            except BaseException:  # cancelled (client gone) after everything landed or was given up on
                self.engine.release(room)
                raise
            problem = f"{len(bad)} of {len(pages)} pages differ from what it sent (first: page {bad[0]})" if bad else ""
        if not bad:
            return
        self.runtime.metrics.failure("checksum")
        self.engine.release(room)
        log.error("room %s: KV from prefill %s arrived corrupted: %s", room, prefill_address, problem)
        await context.abort(grpc.StatusCode.UNAVAILABLE,
                            f"room {room}: KV from prefill {prefill_address} arrived corrupted: {problem}",
                            trailing_metadata=((FAILED_PEER_KEY, prefill_address),))

    async def watch_prefills(self, registry: RegistryClient) -> None:
        """Fail the Prefill calls of a prefill whose registry lease expired (it stopped heartbeating:
        hung or partitioned), instead of waiting for their deadline. Other departures (deregistered,
        replaced, registry unreachable) leave calls alone: the connection itself tells if it is dead.

        Calls are matched by worker id, so the late lease expiry of a killed prefill never fails the
        calls of the new process that took its address meanwhile; and a new worker id at an address
        drops decode's channel to it (PrefillClients.forget): nothing of the old process is reused."""
        async for event in registry.watch(role=common_pb2.WORKER_ROLE_PREFILL):
            worker = event.worker
            address, worker_id = worker.grpc_address, worker.worker_id
            if event.type == bootstrap_pb2.WORKER_EVENT_TYPE_JOINED:
                known = self._prefill_ids.get(address)
                self._prefill_ids[address] = worker_id
                if known is not None and known != worker_id:
                    log.info("prefill %s is a new process (%s, was %s): new channel", address, worker_id, known)
                    self.prefills.forget(address)
            elif event.type == bootstrap_pb2.WORKER_EVENT_TYPE_LEFT:
                current = self._prefill_ids.get(address)
                if current == worker_id:
                    del self._prefill_ids[address]
                if event.reason == "lease expired":
                    self._cancel_calls_of(address, worker_id, current)

    def _cancel_calls_of(self, address: str, worker_id: str, current: str | None) -> None:
        """Cancel the open Prefill calls that went to `worker_id` at `address`. A call sent before decode
        learnt who is there is that worker's unless another one registered at the address since."""
        for room in self.rooms.rooms():
            call = room.call
            if call is None or room.prefill_address != address or call.done():
                continue
            sent_to = self._call_prefill_ids.get(room.id, "")
            if sent_to == worker_id or (not sent_to and current in (None, worker_id)):
                room.lost = f"stopped heartbeating (registry lease of {worker_id} expired)"
                call.cancel()

    async def Abort(self, request: worker_pb2.AbortRequest, context) -> worker_pb2.AbortResponse:
        """Stop a room. A room this servicer works on is cancelled and cleans up after itself: its
        reserved pages go to the quarantine while a prefill may still write into them. Only a room
        whose prompt runs here (a local prefill, in the engine alone) is aborted in the engine,
        since the engine's abort frees a room's reservation at once, which must never happen to
        pages a one-sided write may still land in (the gateway sends Abort when a client leaves)."""
        room = self.rooms.get(request.room)
        if room is None:
            return worker_pb2.AbortResponse(found=False)
        if room.local:
            self.engine.abort(room.id)
        elif room.stage is not Stage.QUARANTINED and room.task is not None:
            room.aborted = True  # the handler then ends the caller's stream with finish reason abort
            room.task.cancel()
        return worker_pb2.AbortResponse(found=True)

    async def GetLoad(self, request, context) -> common_pb2.WorkerLoad:
        return self.runtime.load()
