"""LoRA adapters through the gateway (--enable-lora): vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter, applied to every worker the gateway knows (prefill ones too: a decode
worker's prefill must hold the adapter of each request it runs), and the adapters the workers
serve, for /v1/models. These calls sit behind the gateway's API key like every other non-open
path; the workers' gRPC calls carry the deployment's secret."""

from __future__ import annotations

import asyncio

import grpc
from fastapi import APIRouter, Request
from pydantic import BaseModel
from starlette.responses import PlainTextResponse

from protos.v1 import worker_pb2, worker_pb2_grpc
from services.gateway.errors import GatewayError
from services.gateway.state import GatewayState
from services.gateway.workers import WorkerHandle

router = APIRouter()
CALL_TIMEOUT_S = 60.0  # reading an adapter folder: seconds for a large one
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


async def _on_every_worker(state: GatewayState, method: str, message) -> None:
    """Call `method` on every known worker at once; the first refusal is the answer (naming the
    worker), after all calls ended."""
    workers = state.pool.routable(state.model_name)
    if not workers:
        raise GatewayError(503, "no worker is known to apply the call to", code="no_workers")
    results = await asyncio.gather(*(getattr(_stub(w), method)(message, timeout=CALL_TIMEOUT_S)
                                     for w in workers), return_exceptions=True)
    for worker, result in zip(workers, results, strict=True):
        if isinstance(result, grpc.aio.AioRpcError):
            status, code = _REFUSALS.get(result.code(), (503, "worker_unavailable"))
            raise GatewayError(status, f"{worker.role} worker {worker.address}: {result.details()}",
                               code=code)
        if isinstance(result, BaseException):
            raise result


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> str:
    state = _state(request)
    message = worker_pb2.LoadLoraAdapterRequest(lora_name=body.lora_name, lora_path=body.lora_path)
    await _on_every_worker(state, "LoadLoraAdapter", message)
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> str:
    state = _state(request)
    message = worker_pb2.UnloadLoraAdapterRequest(lora_name=body.lora_name)
    await _on_every_worker(state, "UnloadLoraAdapter", message)
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."


async def served_adapters(state: GatewayState) -> list[str]:
    """The adapters that decode or colocated workers serve (any of them), for /v1/models; a worker
    that does not answer in time is left out."""
    if not state.config.enable_lora:
        return []
    workers = [w for w in state.pool.routable(state.model_name) if w.role != "prefill"]
    results = await asyncio.gather(*(w.worker_stub().ListLoraAdapters(worker_pb2.ListLoraAdaptersRequest(),
                                                                      timeout=5.0) for w in workers),
                                   return_exceptions=True)
    return sorted({name for r in results if isinstance(r, worker_pb2.LoraAdapters) for name in r.names})
