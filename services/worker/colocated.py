"""The colocated worker: one process runs the prompt and the decode loop (`--disaggregation-mode null`).

It serves the same pdserve.v1.Worker contract as a decode worker, so the gateway routes to either,
and it is the baseline every PD output and measurement is compared against.
"""

from __future__ import annotations

import time

import grpc

from protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.worker.model_info import ModelInfoServicer
from services.worker.relay import relay_token_batches
from services.worker.requests import BadRequest, parse_request
from services.worker.runtime import WorkerRuntime


class ColocatedServicer(ModelInfoServicer, worker_pb2_grpc.WorkerServicer):
    """pdserve.v1.Worker over an engine that does both phases. Called by the gateway."""

    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime
        self.engine = runtime.engine

    def live_rooms(self) -> set[str]:
        """The engine knows every live room of a colocated worker."""
        return set()

    async def Generate(self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        arrival = time.perf_counter()
        try:
            parsed = parse_request(self.engine, request.room, request.prompt_token_ids, request.sampling)
        except ValueError as exc:  # BadRequest included
            await context.abort(BadRequest.code, str(exc))
        if self.engine.is_live(parsed.room):
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"room {parsed.room} is already in use on this worker")
        batches = self.engine.generate_batches(parsed.prompt_ids, parsed.params, parsed.room)
        async for response in relay_token_batches(batches, self.runtime.metrics, arrival):
            yield response

    async def Abort(self, request: worker_pb2.AbortRequest, context) -> worker_pb2.AbortResponse:
        found = self.engine.is_live(request.room)
        self.engine.abort(request.room)
        return worker_pb2.AbortResponse(found=found)

    async def GetLoad(self, request, context) -> common_pb2.WorkerLoad:
        return self.runtime.load()
