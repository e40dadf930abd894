"""The colocated worker: one process runs the prompt and the decode loop (`--disaggregation-mode null`).

It serves the same pdserve.v1.Worker contract as a decode worker, so the gateway routes to either,
and it is the baseline every PD output and measurement is compared against.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.worker.role_servicer import RoleServicer
from services.worker.rooms import Room, RoomInUse, Stage
from services.worker.runtime import WorkerRuntime
from services.worker.wire import Refused, abort_with, parse, relay


class ColocatedServicer(RoleServicer[Room], worker_pb2_grpc.WorkerServicer):
    """pdserve.v1.Worker over an engine that does both phases. Called by the gateway."""

    def __init__(self, runtime: WorkerRuntime) -> None:
        super().__init__(runtime, Room)

    async def Generate(self, request: worker_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.GenerateResponse]:
        arrival = time.perf_counter()
        try:
            parsed = await parse(self.engine, request.room, request.prompt_token_ids, request.sampling,
                                 request.images, carried_tokens=request.carried_tokens)
            parsed = await self.with_embeddings(parsed, list(request.images))  # --language-only: EPD
            room = self.rooms.open(parsed.room, Stage.RUNNING, asyncio.current_task())
        except Refused as exc:
            await abort_with(context, exc)
        except RoomInUse as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"room {exc.room.id} is already in use on this worker")
        try:
            async for response in relay(self.engine.generate(parsed), self.runtime.metrics, arrival):
                yield response
        finally:
            self.rooms.close(room)

    async def Abort(self, request: worker_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> worker_pb2.AbortResponse:
        found = self.rooms.get(request.room) is not None
        self.engine.abort(request.room)
        return worker_pb2.AbortResponse(found=found)

    async def GetLoad(self, request: worker_pb2.GetLoadRequest,
                      context: grpc.aio.ServicerContext) -> common_pb2.WorkerLoad:
        return self.runtime.load()
