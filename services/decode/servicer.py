"""The decode worker: pdserve.v1.Worker driving a remote prefill (`--disaggregation-mode decode`).

The servicer parses a request, opens its room, decides where its prompt runs, relays the engine's
tokens and answers Abort. Where the prompt runs:
- on a prefill worker (PD): remote_prefill.py reserves the pages, calls the prefill, checks the
  landing and hands the prefilled request back; the engine's `waiting` and `running` queues count
  it from there;
- here (conditional disaggregation, `--conditional-disaggregation`: a short prompt, a request with
  no prefill worker, or one whose prefill is busy; services/worker/config.py LocalPrefillRule), as
  on a colocated worker, with the same output.
Images (a vision-language model) are decoded here off the event loop (services/worker/wire.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from engine.request import EngineRequest
from protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.decode.remote_prefill import RemotePrefill
from services.decode.room import DecodeRoom
from services.worker.hooks import WorkerHooks
from services.worker.role_servicer import RoleServicer
from services.worker.rooms import RoomInUse, Stage
from services.worker.runtime import WorkerRuntime
from services.worker.wire import BadRequest, Refused, abort_with, parse, relay

log = logging.getLogger("pdserve.decode")


class DecodeServicer(RoleServicer[DecodeRoom], worker_pb2_grpc.WorkerServicer):
    """pdserve.v1.Worker for a decode worker. Called by the gateway; calls prefill workers."""

    def __init__(self, runtime: WorkerRuntime, hooks: WorkerHooks = WorkerHooks()) -> None:
        super().__init__(runtime, DecodeRoom)
        self.remote = RemotePrefill(runtime, self.rooms, hooks)
        self.local_prefill = self.config.local_prefill_rule()
        runtime.metrics.gauge("kv_quarantined_rooms", "Failed requests whose pages wait for their prefill "
                              "to confirm that no KV write can still land",
                              lambda: len(self.rooms.rooms(Stage.QUARANTINED)))

    async def Generate(self, request: worker_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.GenerateResponse]:
        arrival = time.perf_counter()
        prefill_address = request.prefill_address if request.HasField("prefill_address") else ""
        try:
            parsed = await parse(self.engine, request.room, request.prompt_token_ids, request.sampling,
                                 request.images, carried_tokens=request.carried_tokens)
            if not prefill_address and not self.local_prefill.enabled:
                raise BadRequest("a decode worker needs prefill_address: the prefill worker to run the "
                                 "prompt on (or --conditional-disaggregation to run it here)")
            room = self.rooms.open(parsed.room, Stage.PREALLOC, asyncio.current_task())
        except Refused as exc:
            await abort_with(context, exc)
        except RoomInUse as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"room {exc.room.id} is already in use on this worker")
        try:
            parsed = await self._run_prompt(room, parsed, request, prefill_address)
            async for response in relay(self.engine.generate(parsed), self.metrics, arrival):
                yield response
        except Refused as exc:
            await abort_with(context, exc)
        except asyncio.CancelledError:
            if not room.aborted or context.done():
                # the caller left (the gateway cancels, then aborts) or the server stops: nobody to answer
                raise
            # Our Abort cancelled the handler; its caller still reads the stream. End it as a colocated
            # worker ends an aborted request (finish reason abort), not by leaving it open until the
            # caller's deadline. The cleanup (quarantine, released pages) has run already.
            yield worker_pb2.GenerateResponse(
                finish_reason=common_pb2.FINISH_REASON_ABORT,
                usage=worker_pb2.Usage(prompt_tokens=len(parsed.prompt_ids), completion_tokens=0))
        finally:
            if room.stage is not Stage.QUARANTINED:
                self.rooms.close(room)

    async def _run_prompt(self, room: DecodeRoom, parsed: EngineRequest, request: worker_pb2.GenerateRequest,
                          prefill_address: str) -> EngineRequest:
        """The request for the engine: as parsed when its prompt runs here, prefilled (first token
        set, its KV in reserved pages) when a prefill worker ran it. The caller hands it to the
        engine with no await in between."""
        local = self.local_prefill.reason(len(parsed.prompt_ids), prefill_address,
                                          self.remote.open_on(prefill_address))
        if local is None:
            return await self.remote.run(room, parsed, request, prefill_address)
        room.stage, room.local = Stage.RUNNING, True
        self.metrics.local_prefill(local)
        log.debug("room %s: prefill runs on this decode worker (%s, %d prompt tokens)", room.id, local,
                  len(parsed.prompt_ids))
        return parsed

    async def Abort(self, request: worker_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> worker_pb2.AbortResponse:
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

    async def GetLoad(self, request: worker_pb2.GetLoadRequest,
                      context: grpc.aio.ServicerContext) -> common_pb2.WorkerLoad:
        return self.runtime.load()

    async def close(self) -> None:
        await self.remote.close()
