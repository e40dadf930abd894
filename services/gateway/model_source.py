"""A gateway started without --model-path learns its model from the workers.

The seeds' router is started with worker addresses only. The gateway still tokenizes and renders
chat templates, so at start-up it asks the workers it is given (or, with none, the registry's) for
their ModelInfo over gRPC (Worker.GetModelInfo / Prefill.GetModelInfo) until one answers, writes
that worker's tokenizer files into a private folder and serves that model under the name the
worker reports (or --served-model-name, which the worker must then report too), reading tool calls
and thinking with the parsers it reports (--tool-call-parser, --reasoning-parser; the gateway's own
flags win).

From then on a static worker is routed to only once it has reported the same model: same served
name and the same files digest (a worker with another tokenizer would get token ids it reads as
other text). `StaticWorkerCheck` asks each until it answers; one that disagrees is refused with a
log line naming both models and never added to the pool. `RegistryWorkerCheck` applies the same
rule to the workers the registry announces (services.gateway.discovery).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from protos.v1 import worker_pb2, worker_pb2_grpc
from services.common.channels import open_channel
from services.common.model_info import (
    MAX_MODEL_INFO_MESSAGE_BYTES,
    ModelInfoError,
    reported_text_parsers,
    write_model_files,
)
from services.common.registry_client import RegistryClient
from services.common.security import GrpcSecurity
from services.common.text_parsers import TextParsers
from services.gateway.config import StaticWorker
from services.gateway.discovery import stop_task
from services.gateway.workers import ROLE_FROM_PROTO, WorkerPool

log = logging.getLogger("pdserve.gateway")

_RPC_TIMEOUT_S = 10.0
_RETRY_S = 1.0


class ModelUnknown(RuntimeError):
    """No worker reported a usable model before the deadline."""


@dataclass(frozen=True)
class ServedModel:
    """The model this gateway serves, as learned from a worker."""

    name: str
    files_sha256: str
    context_length: int
    source: str  # the worker it was learned from, for logs
    text_parsers: TextParsers = TextParsers()  # the names that worker reports

    def disagreement(self, info: worker_pb2.ModelInfo) -> str | None:
        """Why a worker reporting `info` may not serve this gateway's requests (None: it may)."""
        if info.served_model_name != self.name:
            return f"it serves model {info.served_model_name!r}, this gateway serves {self.name!r}"
        if info.files_sha256 != self.files_sha256:
            return (f"its tokenizer files differ (sha256 {info.files_sha256[:12]}, this gateway's "
                    f"{self.files_sha256[:12]}, from {self.source})")
        return None


async def fetch_model_info(address: str, role: str, security: GrpcSecurity,
                           timeout_s: float = _RPC_TIMEOUT_S) -> worker_pb2.ModelInfo:
    """One GetModelInfo call, on a channel of its own that accepts the bounded file payload."""
    channel = open_channel(address, security, options=[("grpc.max_receive_message_length",
                                                        MAX_MODEL_INFO_MESSAGE_BYTES)])
    try:
        stub = (worker_pb2_grpc.PrefillStub(channel) if role == "prefill"
                else worker_pb2_grpc.WorkerStub(channel))
        return await stub.GetModelInfo(worker_pb2.GetModelInfoRequest(), timeout=timeout_s)
    finally:
        await channel.close()


async def _registry_workers(registry: str, security: GrpcSecurity) -> list[StaticWorker]:
    async with RegistryClient(registry, security=security) as client:
        listed = await client.list()
    return [StaticWorker(ROLE_FROM_PROTO[info.role], info.grpc_address) for info in listed
            if info.role in ROLE_FROM_PROTO and info.grpc_address]


async def learn_model(workers: Sequence[StaticWorker], registry: str | None, security: GrpcSecurity,
                      folder: Path, *, wanted_name: str | None, timeout_s: float) -> ServedModel:
    """Ask `workers` (none given: the registry's) for their model until one reports a usable one;
    write its files into `folder`. Raises ModelUnknown after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    next_note = 0.0
    refused: set[str] = set()
    while True:
        candidates = list(workers)
        if not candidates and registry:
            try:
                candidates = await _registry_workers(registry, security)
            except grpc.aio.AioRpcError as exc:
                log.warning("registry %s: %s %s", registry, exc.code().name, exc.details())
        for worker in candidates:
            try:
                info = await fetch_model_info(worker.address, worker.role, security)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    log.warning("%s %s cannot report its model: %s %s", worker.role, worker.address,
                                exc.code().name, exc.details())
                continue
            if wanted_name and info.served_model_name != wanted_name:
                if worker.address not in refused:
                    refused.add(worker.address)
                    log.error("refusing %s %s: it serves model %r, --served-model-name is %r", worker.role,
                              worker.address, info.served_model_name, wanted_name)
                continue
            try:
                write_model_files(info, folder)
            except (ModelInfoError, OSError) as exc:
                log.error("%s %s reported an unusable model: %s", worker.role, worker.address, exc)
                continue
            log.info("serving model %r as reported by %s %s (context length %s, tokenizer files sha256 %s)",
                     info.served_model_name, worker.role, worker.address, info.context_length or "unknown",
                     info.files_sha256[:12])
            return ServedModel(info.served_model_name, info.files_sha256, info.context_length,
                               f"{worker.role} {worker.address}", reported_text_parsers(info))
        now = time.monotonic()
        if now >= deadline:
            raise ModelUnknown(f"no worker reported its model within {timeout_s:g}s "
                               f"({len(candidates)} asked); start the gateway with --model-path instead")
        if now >= next_note:
            log.info("waiting for a worker to report its model (%d known) ...", len(candidates))
            next_note = now + 10.0
        await asyncio.sleep(_RETRY_S)


class StaticWorkerCheck:
    """Adds each static worker to the pool once it has reported the served model; refuses the
    ones that report another (logged, never routed to). Unreachable workers are asked again every
    second: a worker started after the gateway joins when it comes up."""

    def __init__(self, pool: WorkerPool, workers: Sequence[StaticWorker], model: ServedModel,
                 security: GrpcSecurity) -> None:
        self.pool = pool
        self.model = model
        self.security = security
        self.pending = list(workers)
        self.refused: list[StaticWorker] = []
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="static-worker-check")

    async def _run(self) -> None:
        while self.pending:
            results = await asyncio.gather(*(self._check(worker) for worker in self.pending))
            self.pending = [worker for worker, settled in zip(self.pending, results, strict=True)
                            if not settled]
            if self.pending:
                await asyncio.sleep(_RETRY_S)

    async def _check(self, worker: StaticWorker) -> bool:
        """True once the worker is settled: added or refused."""
        try:
            info = await fetch_model_info(worker.address, worker.role, self.security)
        except grpc.aio.AioRpcError:
            return False
        reason = self.model.disagreement(info)
        if reason is not None:
            self.refused.append(worker)
            log.error("refusing %s %s: %s; not routing to it", worker.role, worker.address, reason)
            return True
        self.pool.add(worker.address, worker.role, self.model.name, static=True)
        return True

    async def close(self) -> None:
        await stop_task(self._task)


class RegistryWorkerCheck:
    """The registry side of the same rule (services.gateway.discovery's WorkerCheck): a worker the
    registry announces is added to the pool only once its GetModelInfo matches the served model.
    One that disagrees is refused until it leaves (a new process at its address is checked
    again); one that does not answer a few tries in a row is asked again at its next heartbeat."""

    def __init__(self, model: ServedModel, security: GrpcSecurity, attempts: int = 5) -> None:
        self.model = model
        self.security = security
        self.attempts = attempts
        self._pending: dict[str, asyncio.Task] = {}   # address -> its check
        self._refused: dict[str, str] = {}            # address -> the worker id refused there

    def submit(self, address: str, role: str, worker_id: str, admit: Callable[[], object]) -> None:
        if address in self._pending or self._refused.get(address) == worker_id:
            return
        self._refused.pop(address, None)
        task = asyncio.get_running_loop().create_task(self._check(address, role, worker_id, admit),
                                                      name=f"model-check {address}")
        self._pending[address] = task
        task.add_done_callback(lambda done: self._pending.pop(address, None)
                               if self._pending.get(address) is done else None)

    async def _check(self, address: str, role: str, worker_id: str, admit: Callable[[], object]) -> None:
        for _ in range(self.attempts):
            try:
                info = await fetch_model_info(address, role, self.security)
            except grpc.aio.AioRpcError:
                await asyncio.sleep(_RETRY_S)
                continue
            reason = self.model.disagreement(info)
            if reason is not None:
                self._refused[address] = worker_id
                log.error("refusing %s %s (id %s): %s; not routing to it", role, address, worker_id, reason)
                return
            admit()
            return
        log.warning("%s %s did not report its model in %d tries; asking again at its next heartbeat",
                    role, address, self.attempts)

    def forget(self, address: str, worker_id: str) -> None:
        task = self._pending.pop(address, None)
        if task is not None:
            task.cancel()
        if self._refused.get(address) == worker_id:
            del self._refused[address]

    async def close(self) -> None:
        tasks = list(self._pending.values())
        self._pending.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
