"""GetModelInfo, shared by the Worker (decode, colocated) and Prefill servicers."""

from __future__ import annotations

import functools

import grpc

from protos.v1 import worker_pb2
from services.common.model_info import ModelInfoError, read_model_info


@functools.cache
def _cached_model_info(model_path: str, served_model_name: str) -> worker_pb2.ModelInfo:
    return read_model_info(model_path, served_model_name)  # the folder does not change while serving


class ModelInfoServicer:
    """Mixin for a servicer with a `runtime`: answers GetModelInfo from the worker's checkpoint folder."""

    async def GetModelInfo(self, request: worker_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> worker_pb2.ModelInfo:
        config = self.runtime.config  # type: ignore[attr-defined]
        try:
            return _cached_model_info(config.engine.model_path, config.model_name)
        except ModelInfoError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except OSError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, f"cannot read the model's tokenizer files: {exc}")
