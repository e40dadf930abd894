"""The prefill worker: pdserve.v1.Prefill (`--disaggregation-mode prefill`), called by decode workers.

The servicer parses a Prefill call, checks that the decode worker serves the same model, opens the
call's room and hands it to its job (job.py: handshake, grant, run, writes, cleanup), then answers
with the first token and the page checksums; it also answers Abort.

Images (a vision-language model): the call carries the encoded images and the prompt before
expansion; they are decoded and the prompt expanded here as decode did (services/worker/wire.py),
and the vision tower runs with the prompt's first chunk. Images that disagree with the prompt's
image-pad tokens (none sent for pads, more than the pads) are refused before anything is held.

Abort (decode gone, client gone, decode's explicit Abort RPC): the job stops the engine work, aborts
every write and waits until none can land, then frees. `Abort` answers only after that, and the
room table remembers the room so a Prefill that arrives after its own Abort is refused rather than
writing into pages decode has already reused.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from protos.v1 import worker_pb2, worker_pb2_grpc
from services.prefill.job import PrefillJobs
from services.prefill.room import PrefillRoom
from services.worker.metrics import HANDSHAKE
from services.worker.role_servicer import RoleServicer
from services.worker.rooms import RoomInUse, Stage
from services.worker.runtime import WorkerRuntime
from services.worker.wire import (
    BadRequest,
    Refused,
    abort_with,
    parse,
    speculative_from_proto,
    token_to_proto,
)


class PrefillServicer(RoleServicer[PrefillRoom], worker_pb2_grpc.PrefillServicer):
    """pdserve.v1.Prefill over the engine's prefill-only requests and the transfer backend."""

    def __init__(self, runtime: WorkerRuntime) -> None:
        super().__init__(runtime, PrefillRoom)
        self.jobs = PrefillJobs(runtime, self.rooms)

    async def Prefill(self, request: worker_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.PrefillResponse:
        arrival = time.perf_counter()
        try:
            parsed = await parse(self.engine, request.room, request.prompt_token_ids, request.sampling,
                                 request.images, prefill_only=True, lora=request.lora_adapter,
                                 carried_tokens=request.carried_tokens)
            if not request.room:
                raise BadRequest("room is required")
            if request.model != self.model_name:
                self.metrics.failure(HANDSHAKE)
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                              f"model mismatch (prefill vs decode): {self.model_name!r} vs {request.model!r}")
            self._check_speculative(request)
            self._check_lora_adapter(request)
            # opened before the handshake, so an Abort that arrives during it finds the room
            room = self.rooms.open(request.room, Stage.HANDSHAKE, asyncio.current_task())
        except Refused as exc:
            await abort_with(context, exc)
        except RoomInUse:
            await context.abort(grpc.StatusCode.ABORTED,
                                f"room {request.room} was aborted or is already running")
        try:
            done = await self.jobs.run(room, request, parsed, self.with_embeddings, arrival)
        except Refused as exc:
            await abort_with(context, exc)
        writes, first = done.writes, done.first
        return worker_pb2.PrefillResponse(
            first_token=token_to_proto(first.token_id, "", first.logprob, first.top_logprobs),
            num_pages_written=writes.pages_pushed, bytes_transferred=writes.bytes_pushed,
            transfer_seconds=done.transfer_seconds, page_checksums=writes.checksums,
            tp_size=self.config.engine.topology().attn_tp_size, num_pages_skipped=writes.skip_pages)

    def _check_speculative(self, request: worker_pb2.PrefillRequest) -> None:
        """Refuse a decode whose speculative-decoding config differs from ours, naming the fields."""
        mine = self.config.engine.speculative
        try:
            differences = mine.differences(speculative_from_proto(request.speculative))
        except ValueError as exc:
            differences = [f"decode's config is invalid here: {exc}"]
        if differences:
            self.metrics.failure(HANDSHAKE)
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "speculative decoding config mismatch "
                          f"(prefill vs decode): {'; '.join(differences)}")

    def _check_lora_adapter(self, request: worker_pb2.PrefillRequest) -> None:
        """Refuse a request whose adapter decode holds from other files than ours (the same name
        loaded from another folder, or reloaded), naming both keys: our K/V would not be its."""
        if not request.lora_adapter_key or self.engine.lora is None:
            return
        mine = self.engine.lora.cache_key(request.lora_adapter)
        if mine != request.lora_adapter_key:
            self.metrics.failure(HANDSHAKE)
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"LoRA adapter {request.lora_adapter!r} differs between prefill and decode "
                          f"(name@files digest, prefill vs decode): {mine} vs {request.lora_adapter_key}")

    async def Abort(self, request: worker_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> worker_pb2.AbortResponse:
        """Stop a room's job and answer once none of its writes can still land, with the checksums of
        the writes it issued (decode waits for those to land before it frees the pages)."""
        room = self.rooms.name_in_abort(request.room)  # a Prefill of it from now on is refused
        tp_size = self.config.engine.topology().attn_tp_size
        if room.stage is Stage.DONE:  # finished, or already stopped (decode cancelling the call comes first)
            return worker_pb2.AbortResponse(found=False, page_checksums=room.checksums, tp_size=tp_size)
        if room.task is not None and not room.closing:
            room.task.cancel()
        await asyncio.shield(room.ended.wait())
        return worker_pb2.AbortResponse(found=True, page_checksums=room.checksums, tp_size=tp_size)

    def close(self) -> None:
        self.jobs.close()
