"""LoRA adapters loaded and unloaded at run time (the LoadLoraAdapter and UnloadLoraAdapter RPCs
every worker role answers; the gateway's /v1/load_lora_adapter and /v1/unload_lora_adapter call
them on each worker), and the adapters a worker serves as it reports them (ListLoraAdapters, the
registry's heartbeats)."""

from __future__ import annotations

import asyncio

import grpc

from engine.api import EngineAPI
from engine.lora.adapter import LoraLoadError, load_adapter
from engine.lora.resolver import AdapterNotFound, resolve_adapter_folder
from engine.lora.slots import LoraSlots
from protos.v1 import common_pb2, worker_pb2
from services.worker.wire import Refused


def _slots(engine: EngineAPI) -> LoraSlots:
    if engine.lora is None:
        raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "this worker was started without --enable-lora")
    return engine.lora


def adapter_refs(engine: EngineAPI) -> list[common_pb2.LoraAdapterRef]:
    """Every adapter the worker serves, by name, with the key its pages are hashed under (none
    without --enable-lora)."""
    slots = engine.lora
    if slots is None:
        return []
    with slots.lock:
        return [common_pb2.LoraAdapterRef(name=name, cache_key=adapter.cache_key)
                for name, adapter in sorted(slots.adapters.items())]


def served(engine: EngineAPI) -> worker_pb2.LoraAdapters:
    refs = adapter_refs(engine)
    return worker_pb2.LoraAdapters(names=[ref.name for ref in refs], adapters=refs)


async def load(engine: EngineAPI, request: worker_pb2.LoadLoraAdapterRequest) -> worker_pb2.LoraAdapters:
    """Read, check and register the adapter (reading runs off the event loop). Without a path, the
    adapter's folder in --lora-resolver-dir (the gateway's on-demand load: NOT_FOUND when it has none)."""
    slots = _slots(engine)
    if not request.lora_name:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "lora_name is required")
    if slots.has(request.lora_name):
        raise Refused(grpc.StatusCode.ALREADY_EXISTS, f"LoRA adapter {request.lora_name!r} is already loaded")
    path = request.lora_path
    if not path:
        if not slots.resolver_dir:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          "lora_path is required (this worker has no --lora-resolver-dir)")
        try:
            path = str(resolve_adapter_folder(slots.resolver_dir, request.lora_name))
        except AdapterNotFound as exc:
            raise Refused(grpc.StatusCode.NOT_FOUND, str(exc)) from None
    try:
        adapter = await asyncio.to_thread(load_adapter, request.lora_name, path,
                                          engine.model_config, slots.max_rank, slots.target_modules)
        slots.register(adapter)
    except LoraLoadError as exc:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
    return served(engine)


def unload(engine: EngineAPI, request: worker_pb2.UnloadLoraAdapterRequest) -> worker_pb2.LoraAdapters:
    """Forget the adapter, unless a request still runs (or waits) under it."""
    slots = _slots(engine)
    try:
        slots.unregister(request.lora_name)
    except KeyError:
        raise Refused(grpc.StatusCode.NOT_FOUND,
                      f"LoRA adapter {request.lora_name!r} is not loaded") from None
    except LoraLoadError as exc:
        raise Refused(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
    return served(engine)
