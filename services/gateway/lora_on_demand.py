"""Adapters loaded on demand: a request names an adapter no route holds, and the workers started
with --lora-resolver-dir load it from the folder of that name there (vLLM's filesystem LoRA
resolver), then the request is routed as if it had been loaded by /v1/load_lora_adapter.

The gateway sends LoadLoraAdapter with the name only (no path) to every worker of the model, over
the deployment's authenticated channels; a worker checks the name and resolves it inside its own
directory (engine.lora.resolver), so no client-given path reaches a file system. Bounded: one load
per name at a time (later requests for it wait for that one), at most MAX_LOADS names loading at
once, and a name no worker could load is answered at once for MISS_TTL_S (a client cycling unknown
names does not make a call per request). An unknown name stays vLLM's 404. Memory is the slot pool's:
loaded adapters wait on the host and only `--max-loras-per-batch` of them occupy slots, idle ones
evicted first (engine.lora.slots).
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from protos.v1 import worker_pb2, worker_pb2_grpc
from services.gateway.workers import WorkerHandle, WorkerPool

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 60.0
REGISTRY_WAIT_S = 5.0
MAX_LOADS = 4
MISS_TTL_S = 2.0
MAX_MISSES = 1024


class OnDemandAdapters:
    """`load(name)`: whether `name` is now held by the model's workers (the dispatcher calls it when
    no route serves a request's adapter, then routes again)."""

    def __init__(self, pool: WorkerPool, model_name: str) -> None:
        self.pool = pool
        self.model_name = model_name
        self._loading: dict[str, asyncio.Task[bool]] = {}
        self._slots = asyncio.Semaphore(MAX_LOADS)
        self._misses: dict[str, float] = {}  # name -> when no worker could load it

    async def load(self, name: str) -> bool:
        missed = self._misses.get(name)
        if missed is not None and time.monotonic() - missed < MISS_TTL_S:
            return False
        task = self._loading.get(name)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._load(name))
            self._loading[name] = task
            task.add_done_callback(lambda _: self._loading.pop(name, None))
        return await asyncio.shield(task)

    async def _load(self, name: str) -> bool:
        async with self._slots:
            workers = self.pool.routable(self.model_name)
            message = worker_pb2.LoadLoraAdapterRequest(lora_name=name)
            results = await asyncio.gather(*(_stub(w).LoadLoraAdapter(message, timeout=CALL_TIMEOUT_S)
                                             for w in workers), return_exceptions=True)
            loaded = [w for w, r in zip(workers, results, strict=True) if _holds(r)]
            if not loaded:
                self._missed(name)
                return False
            log.info("LoRA adapter %r loaded on demand on %d of %d workers", name, len(loaded), len(workers))
            await _until_registry_shows(loaded, name)
            return True

    def _missed(self, name: str) -> None:
        if len(self._misses) >= MAX_MISSES:
            self._misses.pop(next(iter(self._misses)))
        self._misses[name] = time.monotonic()


def _holds(result: object) -> bool:
    """A worker's answer: loaded now, or already held (another load got there first)."""
    if isinstance(result, grpc.aio.AioRpcError):
        return result.code() == grpc.StatusCode.ALREADY_EXISTS
    return not isinstance(result, BaseException)


def _stub(worker: WorkerHandle) -> worker_pb2_grpc.WorkerStub | worker_pb2_grpc.PrefillStub:
    if worker.role == "prefill":
        return worker_pb2_grpc.PrefillStub(worker.channel)
    return worker_pb2_grpc.WorkerStub(worker.channel)


async def _until_registry_shows(workers: list[WorkerHandle], name: str) -> None:
    """Wait (bounded) until the registry's view of the workers that loaded `name` shows it: the
    router reads that view (static workers, whose adapters it does not follow, are not waited for)."""
    deadline = asyncio.get_running_loop().time() + REGISTRY_WAIT_S
    while asyncio.get_running_loop().time() < deadline:
        if all(w.lora_adapters is None or name in w.lora_adapters for w in workers):
            return
        await asyncio.sleep(0.02)
