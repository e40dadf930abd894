"""RoleServicer: what the servicer of each worker role (prefill, decode, colocated) starts from."""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Generic

import grpc

from engine.models.vision import tower_merge_size
from engine.request import EngineRequest
from protos.v1 import worker_pb2
from services.common.model_info import ModelInfoError, read_model_info
from services.common.text_parsers import TextParsers
from services.worker import lora_admin
from services.worker.encoders import EncoderRefused, EncoderUnavailable
from services.worker.rooms import R, RoomTable
from services.worker.runtime import WorkerRuntime
from services.worker.wire import Refused, abort_with


@functools.cache
def _cached_model_info(model_path: str, served_model_name: str,
                       text_parsers: TextParsers) -> worker_pb2.ModelInfo:
    return read_model_info(model_path, served_model_name, text_parsers)  # the folder does not change


class RoleServicer(Generic[R]):
    """The parts of the worker's runtime a servicer uses, by name, the role's room table (of its own
    kind of room, `room_type`; the runtime reads it through RoomView), and GetModelInfo (answered
    from the worker's checkpoint folder) and the LoRA adapter calls (services.worker.lora_admin), which
every worker's gRPC services share."""

    def __init__(self, runtime: WorkerRuntime, room_type: type[R]) -> None:
        self.runtime = runtime
        self.engine = runtime.engine
        self.config = runtime.config
        self.rooms: RoomTable[R] = RoomTable(runtime.config.role, room_type)
        runtime.rooms = self.rooms
        self.metrics = runtime.metrics
        # resolved once: requests name it or are checked against it
        self.model_name = runtime.config.model_name

    async def GetModelInfo(self, request: worker_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> worker_pb2.ModelInfo:
        try:
            return _cached_model_info(self.config.engine.model_path, self.model_name,
                                      self.config.text_parsers)
        except ModelInfoError as exc:
            await abort_with(context, Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)))
        except OSError as exc:
            await abort_with(context, Refused(grpc.StatusCode.INTERNAL,
                                              f"cannot read the model's tokenizer files: {exc}"))

    async def GetImageDrop(self, request: worker_pb2.GetImageDropRequest,
                           context: grpc.aio.ServicerContext) -> worker_pb2.ImageDropInfo:
        drop = self.runtime.image_drop
        return worker_pb2.ImageDropInfo(port=drop.port if drop is not None else 0)

    async def LoadLoraAdapter(self, request: worker_pb2.LoadLoraAdapterRequest,
                              context: grpc.aio.ServicerContext) -> worker_pb2.LoraAdapters:
        try:
            adapters = await lora_admin.load(self.engine, request)
        except Refused as exc:
            await abort_with(context, exc)
        self.runtime.report_adapters()
        return adapters

    async def UnloadLoraAdapter(self, request: worker_pb2.UnloadLoraAdapterRequest,
                                context: grpc.aio.ServicerContext) -> worker_pb2.LoraAdapters:
        try:
            adapters = lora_admin.unload(self.engine, request)
        except Refused as exc:
            await abort_with(context, exc)
        self.runtime.report_adapters()
        return adapters

    async def ListLoraAdapters(self, request: worker_pb2.ListLoraAdaptersRequest,
                               context: grpc.aio.ServicerContext) -> worker_pb2.LoraAdapters:
        return lora_admin.served(self.engine)

    async def with_embeddings(self, parsed: EngineRequest, blobs: list[bytes | memoryview]) -> EngineRequest:
        """A --language-only worker's request with its images' embeddings from an encoder service
        (services/worker/encoders.py); the request unchanged without images or on a worker with
        its own vision tower. Refused with UNAVAILABLE (no encoder could make them: retryable
        elsewhere) or with the encoder's own code when it refused the images."""
        if not parsed.images or self.runtime.encoders is None:
            return parsed
        merge_size = tower_merge_size(self.engine.model_config)
        try:
            rows = await self.runtime.encoders.embeddings(parsed.room, blobs, parsed.images, merge_size)
        except EncoderUnavailable as exc:
            raise Refused(grpc.StatusCode.UNAVAILABLE,
                          f"room {parsed.room}: no image embeddings: {exc}") from None
        except EncoderRefused as exc:
            raise Refused(exc.code, f"room {parsed.room}: the encoder refused the images: {exc}") from None
        return replace(parsed, image_embeddings=rows)
