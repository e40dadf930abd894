"""Decode's side of PD for one request: reserve, grant, call the prefill, check the landing, hand off.

One request, through its stages in the room table (services/worker/rooms.py), driven by
`RemotePrefill.run` for the decode servicer:
  prealloc  wait (FIFO, `PreallocQueue`) until the engine can reserve pages for the prompt; its
            leading full pages come from this worker's prefix cache when they are there
            (decode-side reuse). Pages freed by the engine wake the head of the queue.
  transfer  bind the pages offered to the prefill to the room and a fresh grant (the transfer
            engine checks it before the prefill writes), then call Prefill(room, prompt, dst
            pages, skip_pages, our endpoint) on the prefill worker the gateway chose: it runs the
            prompt and writes the KV of the pages after the `skip_pages` cached ones, then replies
            with the first token. The reply is the completion signal: pages are never read before
            it, and not before they hash to what prefill sent (landing).
  hand-off  the prefilled request (the first token, the reserved pages) goes back to the servicer,
            which gives it to the engine with no await in between: the room is RUNNING.

Images (a vision-language model): the reservation's page hashes carry their digests, and the
Prefill call forwards them encoded with the prompt as the client sent it; the prefill expands it to
the same tokens and runs the vision tower. This worker never does (unless a retraction makes it
recompute).

Failure: if the Prefill call fails, is cancelled, times out, or the prefill's registry lease
expires (prefill_leases.py), `run` raises Refused (UNAVAILABLE unless the prefill said the request
itself is wrong; the gateway may retry on another pair) and hands the offered pages to the
quarantine (quarantine.py), which frees them once no write of the room can still land. A
cancellation (client gone, Abort) takes the same path. Pages that landed but were never handed off
are released here.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import replace

import grpc

from engine.api import EngineAPI
from engine.multimodal.inputs import ImageInput
from engine.page_manager import Reservation
from engine.request import EngineRequest
from libkv.landing import wait_landed
from libkv.transfer import TransferBackend
from libkv.transfer.dp_groups import DPGroupsBackend
from protos.v1 import common_pb2, worker_pb2
from services.decode.prefill_client import PrefillClients, PrefillFailed, PrefillReply
from services.decode.quarantine import PageQuarantine
from services.decode.room import DecodeRoom
from services.worker.hooks import WorkerHooks
from services.worker.rooms import RoomTable, Stage, finish_despite_cancel
from services.worker.runtime import WorkerRuntime
from services.worker.wire import Refused, endpoint_to_proto, speculative_to_proto

log = logging.getLogger("pdserve.decode")


class PreallocTimeout(TimeoutError):
    """No pages became free within the waiting timeout."""


class PreallocQueue:
    """The `prealloc` stage: first come, first served page reservation.

    Only the head of the queue tries to reserve, so a large prompt at the head is not starved by
    small ones behind it (they wait their turn); `asyncio.Lock` wakes waiters in FIFO order. The
    head tries again each time the engine gives pages back (`EngineAPI.pages_freed`).
    """

    def __init__(self, engine: EngineAPI) -> None:
        self.engine = engine
        self._turn = asyncio.Lock()

    async def reserve(self, room: str, prompt_ids: list[int], timeout_s: float,
                      images: Sequence[ImageInput] = (), lora: str | None = None) -> Reservation:
        """Pages for the prompt under `room`, its leading full pages from the prefix cache when
        there (those need no transfer: `Reservation.tail` is what prefill must write). `images`
        and the LoRA adapter `lora` salt the page hashes, as the prefill's scheduler salts them."""
        deadline = time.monotonic() + timeout_s
        timeout = PreallocTimeout(f"no KV pages for {len(prompt_ids)} tokens within {timeout_s:.0f}s")
        try:
            await asyncio.wait_for(self._turn.acquire(), timeout=timeout_s)
        except asyncio.TimeoutError:  # TimeoutError itself only from Python 3.11 on
            raise timeout from None
        try:
            hashes = self.engine.prompt_hashes(prompt_ids, images, lora)  # once, not at every try
            with self.engine.pages_freed() as freed:
                while True:
                    freed.clear()  # before trying: pages freed during the try wake the wait below
                    reservation = self.engine.reserve_prompt(room, prompt_ids, hashes)
                    if reservation is not None:
                        return reservation
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise timeout
                    try:
                        await asyncio.wait_for(freed.wait(), timeout=left)
                    except asyncio.TimeoutError:
                        raise timeout from None
        finally:
            self._turn.release()


class RemotePrefill:
    """Decode's remote prefills (see the module docstring). One per decode worker; its servicer
    calls `run` for every request whose prompt runs on a prefill worker."""

    def __init__(self, runtime: WorkerRuntime, rooms: RoomTable[DecodeRoom], hooks: WorkerHooks) -> None:
        if runtime.backend is None:
            raise ValueError("a decode worker needs a transfer backend")
        self.runtime = runtime
        self.engine = runtime.engine
        self.config = runtime.config
        self.metrics = runtime.metrics
        self.backend: TransferBackend = runtime.backend
        self.rooms = rooms
        self.prealloc = PreallocQueue(self.engine)
        # An Abort waits until the prefill stopped every write, which is bounded by one write's timeout.
        self.prefills = PrefillClients(abort_timeout_s=self.config.transfer_timeout + 5.0,
                                       security=self.config.security)
        self.quarantine = PageQuarantine(self.engine, self.backend, self.prefills, rooms,
                                         give_up_s=self.config.quarantine_timeout)
        self.before_admission = hooks.before_admission
        # A one-sided write's "done" does not say it landed; the checksums do (libkv.landing), so
        # they are always on there: --no-kv-checksum only spares two-sided engines the hashing.
        self.checksums = self.backend.moves_bytes and (self.config.kv_checksum or self.backend.one_sided)
        self._endpoint = endpoint_to_proto(self.backend.endpoint())
        # The registry worker id at each prefill address (prefill_leases.py keeps it).
        self.prefill_ids: dict[str, str] = {}

    def open_on(self, prefill_address: str) -> int:
        """Prefill calls this worker has open on `prefill_address` (its queue, as far as we load it)."""
        return sum(1 for room in self.rooms.rooms()
                   if room.call is not None and room.prefill_address == prefill_address)

    async def run(self, room: DecodeRoom, request: EngineRequest, wire: worker_pb2.GenerateRequest,
                  prefill_address: str) -> EngineRequest:
        """prealloc, transfer, landing. Returns the prefilled request (its first token set; the
        prompt's KV in the pages reserved under the room), for the engine to take at once; the
        room is RUNNING then. Raises Refused when the request cannot go on (its pages quarantined
        or released); a cancellation cleans up the same way and propagates."""
        try:
            room.reservation = await self.prealloc.reserve(room.id, request.prompt_ids,
                                                           self.config.waiting_timeout, request.images,
                                                           request.lora)
        except PreallocTimeout as exc:
            self.metrics.failure("prealloc")
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"room {room.id}: {exc}") from None
        room.stage = Stage.TRANSFER
        pages = room.reservation.tail
        reply = await self._transfer(room, request, wire, prefill_address, room.reservation)
        self.backend.release_expectation(room.id)
        if self.checksums:
            await self._check_landed(room.id, pages, reply, prefill_address)
        self._count_saved(room.reservation)
        await self._before_admission(room.id)
        room.stage, room.reservation = Stage.RUNNING, None
        return replace(request, first_token=reply.first)

    async def _transfer(self, room: DecodeRoom, request: EngineRequest, wire: worker_pb2.GenerateRequest,
                        prefill_address: str, reservation: Reservation) -> PrefillReply:
        """Offer the reservation's tail (its cached pages are shared with other requests and must
        never be written) to the prefill under a grant, and call it."""
        pages = reservation.tail
        if self.checksums and self.backend.one_sided:
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
            room=room.id, prompt_token_ids=wire.prompt_token_ids if wire.images else request.prompt_ids,
            sampling=wire.sampling, dst_page_ids=pages, dst=self._endpoint_for(room.id),
            decode_worker_id=self.runtime.registry.worker_id if self.runtime.registry else "",
            model=self.config.model_name, grant=grant, page_checksums=self.checksums,
            skip_pages=reservation.cached_pages,
            speculative=speculative_to_proto(self.config.engine.speculative),
            lora_adapter=request.lora or "", carried_tokens=request.carried_tokens,
            lora_adapter_key=(self.engine.lora.cache_key(request.lora)
                              if request.lora and self.engine.lora is not None else ""))
        room.prefill_address = prefill_address
        room.prefill_id = self.prefill_ids.get(prefill_address, "")
        call = room.call = asyncio.ensure_future(self.prefills.prefill(
            prefill_address, prefill_request, request.params,
            timeout_s=self.config.bootstrap_timeout + self.config.waiting_timeout,
            images=wire.images))  # views into the bytes decode received (worker/images_apart.py)
        try:
            # not `await call`: a watcher cancelling the call is a failure, not ours
            await asyncio.wait({call})
            if call.cancelled():
                raise PrefillFailed(f"prefill {prefill_address} {room.lost or 'was lost'}",
                                    grpc.StatusCode.UNAVAILABLE, "prefill")
            return call.result()
        except PrefillFailed as exc:
            self.metrics.failure(exc.stage)
            self.quarantine.hold(room, pages)
            log.warning("room %s: %s", room.id, exc)
            raise Refused(exc.code, f"room {room.id}: {exc}", failed_peer=prefill_address) from None
        except BaseException:  # cancelled (client gone, shutdown): stop prefill, free pages when safe
            call.cancel()
            self.quarantine.hold(room, pages)
            raise
        finally:
            room.call, room.lost = None, ""

    def _endpoint_for(self, room: str) -> common_pb2.TransferEndpoint:
        """Where the prefill writes the room's pages: under DP attention, its group's ranks."""
        if isinstance(self.backend, DPGroupsBackend):
            return endpoint_to_proto(self.backend.endpoint_for(room))
        return self._endpoint

    async def _check_landed(self, room: str, pages: list[int], reply: PrefillReply,
                            prefill_address: str) -> None:
        """Wait until the pages hold what prefill sent (libkv.landing: the writes may still be on
        their way), bounded; pages that still differ then fail the request (retryable on another
        pair) before it joins the batch. The wait finishes even if the request is cancelled
        meanwhile, so pages are never freed while bytes for them may still land."""
        sent = reply.page_checksums
        if len(sent) != len(pages):
            bad, problem = pages, f"{len(sent)} checksums for {len(pages)} pages"
        else:
            try:
                bad = await finish_despite_cancel(wait_landed(self.engine.pool_for(room), pages, sent,
                                                              sender_tp_size=reply.tp_size))
            except BaseException:  # cancelled (client gone) after everything landed or was given up on
                self.engine.release(room)
                raise
            problem = (f"{len(bad)} of {len(pages)} pages differ from what it sent (first: page {bad[0]})"
                       if bad else "")
        if not bad:
            return
        self.metrics.failure("checksum")
        self.engine.release(room)
        log.error("room %s: KV from prefill %s arrived corrupted: %s", room, prefill_address, problem)
        raise Refused(grpc.StatusCode.UNAVAILABLE,
                      f"room {room}: KV from prefill {prefill_address} arrived corrupted: {problem}",
                      failed_peer=prefill_address)

    def _count_saved(self, reservation: Reservation) -> None:
        """Bytes the prefix cache spared the transfer, in the units of the prefill's
        kv_transfer_bytes_total: every rank of this worker gets its own pages (its KV heads; MLA:
        the whole latent), so a page ships tp_size rank pages of every layer (under pipeline
        parallelism each stage's ranks hold their layers' part)."""
        if not reservation.cached_pages:
            return
        layout = self.engine.kv_layout
        shipped_page_nbytes = (layout.page_nbytes // layout.num_layers * self.engine.model_config.num_layers
                               * self.config.engine.topology().attn_tp_size)
        self.metrics.transfer_bytes_saved.inc(reservation.cached_pages * shipped_page_nbytes)

    async def _before_admission(self, room: str) -> None:
        """The window between "the room's KV landed" (prefill is done with it) and "the engine took
        the room into its batch". The reserved pages are the engine's reservation until then, which
        no abort path frees (the engine does not know the request yet, and the quarantine is only
        for pages a write may still reach), so a request cancelled here frees them itself. Without a
        hook there is no await in the window; a test holds requests in it (WorkerHooks)."""
        if self.before_admission is None:
            return
        try:
            await self.before_admission(room)
        except BaseException:
            self.engine.release(room)
            raise

    async def close(self) -> None:
        await self.quarantine.close()
        await self.prefills.close()
