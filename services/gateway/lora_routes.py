"""LoRA adapters through the gateway (--enable-lora): vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter, applied to every worker the gateway knows (prefill ones too: a decode
worker's prefill must hold the adapter of each request it runs; a refusal names every worker that
refused), and the adapters the fleet serves, for /v1/models. These calls sit behind the gateway's
API key like every other non-open path; the workers' gRPC calls carry the deployment's secret."""

from __future__ import annotations

import asyncio

import grpc
from fastapi import APIRouter, Request
from pydantic import BaseModel
from starlette.responses import PlainTextResponse

from protos.v1 import worker_pb2, worker_pb2_grpc
from services.gateway.errors import GatewayError
from services.gateway.state import GatewayState
from services.gateway.workers import WorkerHandle, listed_adapters, servable_adapters

router = APIRouter()
CALL_TIMEOUT_S = 60.0  # reading an adapter folder: seconds for a large one
REGISTRY_WAIT_S = 5.0  # a worker reports a change of adapters at once: a heartbeat's round trip
# A worker's refusal -> (HTTP status, error code)
_REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_lora_adapter"),
             grpc.StatusCode.ALREADY_EXISTS: (400, "lora_adapter_exists"),
             grpc.StatusCode.NOT_FOUND: (404, "lora_adapter_not_found"),
             grpc.StatusCode.FAILED_PRECONDITION: (409, "lora_adapter_in_use")}


class LoadLoraAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; names are what pdserve goes by


def _state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    if not state.config.enable_lora:
        # as vLLM, whose run-time adapter routes exist only when turned on: not found
        raise GatewayError(404, "LoRA adapters are off: start the gateway (and workers) with --enable-lora",
                           code="lora_disabled")
    return state


def _stub(worker: WorkerHandle) -> worker_pb2_grpc.WorkerStub | worker_pb2_grpc.PrefillStub:
    if worker.role == "prefill":
        return worker_pb2_grpc.PrefillStub(worker.channel)
    return worker_pb2_grpc.WorkerStub(worker.channel)


async def _on_every_worker(state: GatewayState, method: str, message) -> list[WorkerHandle]:
    """Call `method` on every known worker at once and return them. When some refuse or fail, the
    answer names each of those (and how many did it), with the first refusal's status."""
    workers = state.pool.routable(state.model_name)
    if not workers:
        raise GatewayError(503, "no worker is known to apply the call to", code="no_workers")
    results = await asyncio.gather(*(getattr(_stub(w), method)(message, timeout=CALL_TIMEOUT_S)
                                     for w in workers), return_exceptions=True)
    failed: list[tuple[WorkerHandle, grpc.aio.AioRpcError]] = []
    for worker, result in zip(workers, results, strict=True):
        if isinstance(result, BaseException):
            if not isinstance(result, grpc.aio.AioRpcError):
                raise result
            failed.append((worker, result))
    if failed:
        status, code = _REFUSALS.get(failed[0][1].code(), (503, "worker_unavailable"))
        named = "; ".join(f"{w.role} worker {w.address}: {exc.details()}" for w, exc in failed)
        done = len(workers) - len(failed)
        raise GatewayError(status, f"{named} ({done} of {len(workers)} workers did it)" if done else named,
                           code=code)
    return workers


async def _until_registry_shows(workers: list[WorkerHandle], name: str, loaded: bool) -> None:
    """Wait (bounded) until the registry's view of every registered worker of `workers` agrees that
    it holds `name` (or not): the gateway routes on that view, so once the call answers, requests
    for the adapter are routed to every worker that loaded it. Workers whose adapters the gateway
    does not know from the registry (static ones) are not waited for."""
    deadline = asyncio.get_running_loop().time() + REGISTRY_WAIT_S
    while asyncio.get_running_loop().time() < deadline:
        if all(w.lora_adapters is None or (name in w.lora_adapters) == loaded for w in workers):
            return
        await asyncio.sleep(0.02)


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> str:
    state = _state(request)
    message = worker_pb2.LoadLoraAdapterRequest(lora_name=body.lora_name, lora_path=body.lora_path)
    workers = await _on_every_worker(state, "LoadLoraAdapter", message)
    await _until_registry_shows(workers, body.lora_name, True)
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> str:
    state = _state(request)
    message = worker_pb2.UnloadLoraAdapterRequest(lora_name=body.lora_name)
    workers = await _on_every_worker(state, "UnloadLoraAdapter", message)
    await _until_registry_shows(workers, body.lora_name, False)
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."


async def served_adapters(state: GatewayState) -> list[str]:
    """The adapters a request can be routed with, for /v1/models: those the registry says some
    route of workers holds whole (workers.servable_adapters), and those that static decode or
    colocated workers, whose adapters the gateway does not follow, say they serve (a worker that
    does not answer in time is left out)."""
    if not state.config.enable_lora:
        return []
    workers = state.pool.routable(state.model_name)
    names = servable_adapters(workers, listed_adapters(workers))
    static = [w for w in workers if w.role != "prefill" and w.lora_adapters is None]
    results = await asyncio.gather(*(w.worker_stub().ListLoraAdapters(worker_pb2.ListLoraAdaptersRequest(),
                                                                      timeout=5.0) for w in static),
                                   return_exceptions=True)
    names.update(name for r in results if isinstance(r, worker_pb2.LoraAdapters) for name in r.names)
    return sorted(names)
