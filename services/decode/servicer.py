"""The decode worker: pdserve.v1.Worker driving a remote prefill (`--disaggregation-mode decode`).

One request, as docs/architecture.md draws it:
  prealloc  wait (FIFO) until the engine can reserve pages for the prompt; its leading full pages
            come from this worker's prefix cache when they are there (decode-side reuse)
  transfer  call Prefill(room, prompt, dst pages, skip_pages, our endpoint) on the prefill worker
            the gateway chose; it runs the prompt and writes the KV of the pages after the
            `skip_pages` cached ones into the reserved pages, then replies with the first token.
            The reply is the completion signal: pages are never read before it.
  waiting   the engine takes the reserved pages and the first token...
  running   ...and the request decodes in the running batch; tokens stream back.

Conditional disaggregation (`--conditional-disaggregation`, local_prefill.py): a short prompt, a
request with no prefill worker, or one whose prefill is busy runs here instead, as on a colocated
worker (the engine's own waiting -> running queues), with the same output.

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

import grpc

from engine.outputs import FirstToken
from libkv.landing import wait_landed
from protos.v1 import bootstrap_pb2, common_pb2, worker_pb2, worker_pb2_grpc
from services.common.convert import endpoint_to_proto, sampling_to_proto
from services.common.registry_client import RegistryClient
from services.common.tasks import finish_despite_cancel
from services.decode.prealloc import PreallocQueue, PreallocTimeout
from services.decode.prefill_client import PrefillClients, PrefillFailed
from services.decode.quarantine import PageQuarantine
from services.worker.model_info import ModelInfoServicer
from services.worker.relay import relay_token_batches, relay_tokens
from services.worker.requests import BadRequest, parse_request
from services.worker.runtime import WorkerRuntime

log = logging.getLogger("pdserve.decode")

# Trailing metadata naming the worker that caused a failure (here: the prefill), so the gateway
# blames and retries around the right worker without parsing messages.
FAILED_PEER_KEY = "pdserve-failed-peer"


class DecodeServicer(ModelInfoServicer, worker_pb2_grpc.WorkerServicer):
    """pdserve.v1.Worker for a decode worker. Called by the gateway; calls prefill workers."""

    def __init__(self, runtime: WorkerRuntime) -> None:
        assert runtime.backend is not None
        self.runtime = runtime
        self.engine = runtime.engine
        self.backend = runtime.backend
        self.config = runtime.config
        self.queues = runtime.queues
        self.prealloc = PreallocQueue(self.engine)
        # An Abort waits until the prefill stopped every write, which is bounded by one write's timeout.
        self.prefills = PrefillClients(abort_timeout_s=self.config.transfer_timeout + 5.0,
                                       security=self.config.security)
        self.quarantine = PageQuarantine(self.engine, self.backend, self.prefills,
                                         give_up_s=self.config.quarantine_timeout)
        runtime.metrics.gauge("kv_quarantined_rooms", "Failed requests whose pages wait for their prefill "
                              "to confirm that no KV write can still land", lambda: len(self.quarantine.rooms()))
        # A one-sided write's "done" does not say it landed; the checksums do (landing.py), so
        # they are always on there: --no-kv-checksum only spares two-sided engines the hashing.
        self._checksums = self.backend.moves_bytes and (self.config.kv_checksum or self.backend.one_sided)
        self._endpoint = endpoint_to_proto(runtime.backend.endpoint())
        self._tasks: dict[str, asyncio.Task] = {}
        self._calls: dict[str, tuple[str, asyncio.Future]] = {}  # room -> (prefill address, Prefill call)
        self._lost: dict[str, str] = {}  # room -> why its prefill was given up on
        self.local_prefill = self.config.local_prefill_rule()

    def _open_on(self, prefill_address: str) -> int:
        """Prefill calls this worker has open on `prefill_address` (its queue, as far as we load it)."""
        return sum(1 for address, _ in self._calls.values() if address == prefill_address)

    def live_rooms(self) -> set[str]:
        """Rooms this servicer is working on or keeps quarantined (for the leak detector)."""
        return set(self._tasks) | self.quarantine.rooms()

    async def Generate(self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        arrival = time.perf_counter()
        try:
            parsed = parse_request(self.engine, request.room, request.prompt_token_ids, request.sampling)
            prefill_address = request.prefill_address if request.HasField("prefill_address") else ""
            if not prefill_address and not self.local_prefill.enabled:
                raise BadRequest("a decode worker needs prefill_address: the prefill worker to run the prompt on "
                                 "(or --conditional-disaggregation to run it here)")
        except ValueError as exc:
            await context.abort(BadRequest.code, str(exc))
        room, prompt, params = parsed.room, parsed.prompt_ids, parsed.params
        if room in self._tasks or room in self.quarantine.rooms() or self.engine.is_live(room):
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"room {room} is already in use on this worker")
        local = self.local_prefill.reason(len(prompt), prefill_address, self._open_on(prefill_address))
        if local is not None:
            self.runtime.metrics.local_prefill(local)
            log.debug("room %s: prefill runs on this decode worker (%s, %d prompt tokens)", room, local, len(prompt))
            batches = self.engine.generate_batches(prompt, params, room)
            async for response in relay_token_batches(batches, self.runtime.metrics, arrival):
                yield response
            return
        self._tasks[room] = asyncio.current_task()
        try:
            first = await self._prefill_remotely(room, prompt, params, prefill_address, context)
            self.queues.move(room, "waiting")
            outputs = self.engine.generate_prefilled(room, prompt, first, params)
            self.queues.leave(room)  # the engine's own waiting/running queues take over
            async for response in relay_tokens(outputs, self.runtime.metrics, arrival):
                yield response
        finally:
            self.queues.leave(room)
            self._tasks.pop(room, None)

    async def _prefill_remotely(self, room: str, prompt: list[int], params, prefill_address: str,
                                context: grpc.aio.ServicerContext) -> FirstToken:
        """prealloc + transfer. Returns the first token with the prompt's KV in the reserved pages."""
        self.queues.move(room, "prealloc")
        try:
            reservation = await self.prealloc.reserve(room, prompt, self.config.waiting_timeout)
        except PreallocTimeout as exc:
            self.runtime.metrics.failure("prealloc")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"room {room}: {exc}")
        self.queues.move(room, "transfer")
        # Only the pages after the ones reused from our prefix cache are offered to the prefill:
        # the cached ones are shared with other requests and must never be written.
        pages = reservation.tail
        if self._checksums and self.backend.one_sided:
            # The landing check takes matching bytes as proof of arrival; a page that held this
            # same prompt before would match before the write lands (KVPool.poison). Inline, not
            # in a thread: no await between reserving and the try below that frees on failure.
            self.engine.pool.poison(pages)
        # Binds the pages to this room and request: the prefill checks the binding through the
        # transfer engine before it writes (two-sided engines also check every write), so only the
        # prefill given this grant can fill them.
        grant = secrets.token_bytes(16)
        self.backend.expect(room, pages, grant=grant)
        prefill_request = worker_pb2.PrefillRequest(
            room=room, prompt_token_ids=prompt, sampling=sampling_to_proto(params), dst_page_ids=pages,
            dst=self._endpoint, decode_worker_id=self.runtime.registry.worker_id if self.runtime.registry else "",
            model=self.config.model_name, grant=grant, page_checksums=self._checksums,
            skip_pages=reservation.cached_pages)
        call = asyncio.ensure_future(self.prefills.prefill(
            prefill_address, prefill_request, params,
            timeout_s=self.config.bootstrap_timeout + self.config.waiting_timeout))
        self._calls[room] = (prefill_address, call)
        try:
            await asyncio.wait({call})  # not `await call`: a watcher cancelling the call is a failure, not ours
            if call.cancelled():
                raise PrefillFailed(f"prefill {prefill_address} {self._lost.pop(room, 'was lost')}",
                                    grpc.StatusCode.UNAVAILABLE, "prefill")
            reply = call.result()
        except PrefillFailed as exc:
            self.runtime.metrics.failure(exc.stage)
            self.quarantine.hold(room, prefill_address, pages)
            log.warning("room %s: %s", room, exc)
            await context.abort(exc.code, f"room {room}: {exc}",
                                trailing_metadata=((FAILED_PEER_KEY, prefill_address),))
        except BaseException:  # cancelled (client gone, shutdown): stop prefill, free pages when safe
            call.cancel()
            self.quarantine.hold(room, prefill_address, pages)
            raise
        finally:
            self._calls.pop(room, None)
            self._lost.pop(room, None)
        self.backend.release_expectation(room)
        if self._checksums:
            await self._check_arrived(room, pages, reply.page_checksums, prefill_address, context, reply.tp_size)
        if reservation.cached_pages:
            self.runtime.metrics.transfer_bytes_saved.inc(reservation.cached_pages * self.engine.kv_layout.page_nbytes)
        return reply.first

    async def _check_arrived(self, room: str, pages: list[int], sent: list[int], prefill_address: str,
                             context: grpc.aio.ServicerContext, sender_tp_size: int = 1) -> None:
        """Wait until the pages hold what prefill sent (landing.py: the writes may still be on
        their way), bounded; pages that still differ then fail the request (retryable on another
        pair) before it joins the batch. The wait finishes even if the request is cancelled
        meanwhile, so pages are never freed while bytes for them may still land."""
        if len(sent) != len(pages):
            bad, problem = pages, f"{len(sent)} checksums for {len(pages)} pages"
        else:
            try:
                bad = await finish_despite_cancel(wait_landed(self.engine.pool, pages, sent,
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
        replaced, registry unreachable) leave calls alone: the connection itself tells if it is dead."""
        async for event in registry.watch(role=common_pb2.WORKER_ROLE_PREFILL):
            if event.type == bootstrap_pb2.WORKER_EVENT_TYPE_LEFT and event.reason == "lease expired":
                address = event.worker.grpc_address
                for room, (prefill_address, call) in list(self._calls.items()):
                    if prefill_address == address and not call.done():
                        self._lost[room] = f"stopped heartbeating (registry lease of {event.worker.worker_id} expired)"
                        call.cancel()

    async def Abort(self, request: worker_pb2.AbortRequest, context) -> worker_pb2.AbortResponse:
        """Stop a room. A room this servicer works on is cancelled and cleans up after itself: its
        reserved pages go to the quarantine while a prefill may still write into them. Only a room
        it does not hold (a local prefill, running in the engine alone) is aborted in the engine,
        since the engine's abort frees a room's reservation at once, which must never happen to
        pages a one-sided write may still land in (the gateway sends Abort when a client leaves)."""
        room = request.room
        task = self._tasks.get(room)
        quarantined = room in self.quarantine.rooms()
        found = task is not None or quarantined or self.engine.is_live(room)
        if task is not None:
            task.cancel()
        elif not quarantined:
            self.engine.abort(room)
        return worker_pb2.AbortResponse(found=found)

    async def GetLoad(self, request, context) -> common_pb2.WorkerLoad:
        return self.runtime.load()
