"""RoleServicer: what the servicer of each worker role (prefill, decode, colocated) starts from."""

from __future__ import annotations

import functools

import grpc

from protos.v1 import worker_pb2
from services.common.model_info import ModelInfoError, read_model_info
from services.worker.runtime import WorkerRuntime


@functools.cache
def _cached_model_info(model_path: str, served_model_name: str) -> worker_pb2.ModelInfo:
    return read_model_info(model_path, served_model_name)  # the folder does not change while serving


class RoleServicer:
    """The parts of the worker's runtime a servicer uses, by name, and GetModelInfo (answered from the
    worker's checkpoint folder), which every worker's gRPC services share."""

    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime
        self.engine = runtime.engine
        self.config = runtime.config
        self.rooms = runtime.rooms
        self.metrics = runtime.metrics
        self.model_name = runtime.config.model_name  # resolved once: requests name it or are checked against it

    async def GetModelInfo(self, request: worker_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> worker_pb2.ModelInfo:
        try:
            return _cached_model_info(self.config.engine.model_path, self.model_name)
        except ModelInfoError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except OSError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, f"cannot read the model's tokenizer files: {exc}")
