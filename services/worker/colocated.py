"""The colocated worker: one process runs the prompt and the decode loop (`--disaggregation-mode null`).

It serves the same pdserve.v1.Worker contract as a decode worker, so the gateway routes to either,
and it is the baseline every PD output and measurement is compared against.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.worker.role_servicer import RoleServicer
from services.worker.rooms import RoomInUse, Stage
from services.worker.wire import BadRequest, parse_request, relay


class ColocatedServicer(RoleServicer, worker_pb2_grpc.WorkerServicer):
    """pdserve.v1.Worker over an engine that does both phases. Called by the gateway."""

    async def Generate(self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        arrival = time.perf_counter()
        try:
            if request.images:  # decoding and resizing images: off the event loop
                parsed = await asyncio.to_thread(parse_request, self.engine, request.room, request.prompt_token_ids,
                                                 request.sampling, images=list(request.images))
            else:
                parsed = parse_request(self.engine, request.room, request.prompt_token_ids, request.sampling)
        except ValueError as exc:  # BadRequest included
            await context.abort(BadRequest.code, str(exc))
        if parsed.images and self.runtime.encoders is not None:  # --language-only: EPD
            parsed = await self.with_embeddings(parsed, list(request.images), context)
        try:
            room = self.rooms.open(parsed.room, Stage.RUNNING, asyncio.current_task())
        except RoomInUse:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"room {parsed.room} is already in use on this worker")
        try:
            async for response in relay(self.engine.generate(parsed), self.runtime.metrics, arrival):
                yield response
        finally:
            self.rooms.close(room)

    async def Abort(self, request: worker_pb2.AbortRequest, context) -> worker_pb2.AbortResponse:
        found = self.rooms.get(request.room) is not None
        self.engine.abort(request.room)
        return worker_pb2.AbortResponse(found=found)

    async def GetLoad(self, request, context) -> common_pb2.WorkerLoad:
        return self.runtime.load()
