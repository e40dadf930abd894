"""The registry's state: live workers and their leases (the watchers told about changes: watchers.py).

Pure asyncio, no gRPC: `servicer.py` maps RPCs onto these methods and the exceptions below onto
status codes. The data model is the pdserve.v1 protobuf messages themselves (WorkerInfo,
WorkerLoad, Lease, WorkerEvent): the registry stores what workers declare and hands the same
messages to watchers, so there is no second copy of every field to keep in sync.

Leases: a worker gets a lease at `register`; each `heartbeat` renews it for `ttl_s =
heartbeat_interval_s * heartbeat_max_failure`. The expiry task removes workers whose lease ran
out and tells watchers (LEFT, reason "lease expired"); the worker's next heartbeat then fails with
LeaseNotFound and it registers again under a new worker id.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from protos.v1 import bootstrap_pb2, common_pb2
from services.bootstrap.watchers import (
    JOINED,
    LEFT,
    ROLE_NAMES,
    UPDATED,
    RegistryStats,
    Watcher,
    Watchers,
    matches,
    role_name,
)

log = logging.getLogger("pdserve.bootstrap")

REASON_DEREGISTERED = "deregistered"
REASON_EXPIRED = "lease expired"
REASON_REPLACED = "replaced"

# Labels of pdserve:bootstrap_registrations_refused_total
REFUSED_INVALID = "invalid"
REFUSED_LAYOUT = "layout_mismatch"
REFUSED_BACKEND = "backend_mismatch"



class InvalidWorker(ValueError):
    """A registration lacks a field every worker must declare (INVALID_ARGUMENT)."""


class RegistrationRefused(Exception):
    """A worker disagrees with the workers of its model on KV layout or transfer backend
    (FAILED_PRECONDITION); the message names both values. `kind` is the metrics label."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind

    def __str__(self) -> str:
        return str(self.args[0])


class LeaseNotFound(KeyError):
    """The lease expired, was deregistered or was replaced (NOT_FOUND): register again."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "lease not found"


def layout_differences(new: common_pb2.KVLayout, registered: common_pb2.KVLayout) -> list[str]:
    """Each differing KVLayout field as 'name: new vs registered' (torch-free twin of
    libkv.KVLayout.differences, so the registry does not import torch)."""
    return [f"{f.name}: {getattr(new, f.name)} vs {getattr(registered, f.name)}"
            for f in common_pb2.KVLayout.DESCRIPTOR.fields
            if getattr(new, f.name) != getattr(registered, f.name)]


def describe_layout(layout: common_pb2.KVLayout) -> str:
    if layout.kv_lora_rank:  # an MLA latent layout (libkv.layout.KVLayout.describe says the same)
        return (f"layers={layout.num_layers} mla kv_lora_rank={layout.kv_lora_rank} "
                f"qk_rope_head_dim={layout.qk_rope_head_dim} page_size={layout.page_size} "
                f"dtype={layout.dtype}")
    return (f"layers={layout.num_layers} kv_heads={layout.num_kv_heads} head_dim={layout.head_dim} "
            f"page_size={layout.page_size} dtype={layout.dtype}")


@dataclass
class _Entry:
    info: bootstrap_pb2.WorkerInfo
    lease_id: str
    expires_at: float


class Registry:
    """Workers by id with heartbeat leases, a consistency check per model, and watchers.

    Callers: the Bootstrap servicer (one call per RPC) and tests. All methods run on the event
    loop thread; `start()` launches the expiry task, `close()` stops it and ends every watch.
    """

    def __init__(self, heartbeat_interval_s: float, heartbeat_max_failure: int, *,
                 watcher_max_queued: int = 1024, clock: Callable[[], float] = time.monotonic,
                 instance: str | None = None) -> None:
        if heartbeat_interval_s <= 0 or heartbeat_max_failure < 1:
            raise ValueError(f"heartbeat interval must be > 0 and max failures >= 1, got "
                             f"{heartbeat_interval_s} and {heartbeat_max_failure}")
        self.heartbeat_interval_s = heartbeat_interval_s
        self.ttl_s = heartbeat_interval_s * heartbeat_max_failure
        self.watcher_max_queued = watcher_max_queued
        self.stats = RegistryStats()
        self._clock = clock
        self._entries: dict[str, _Entry] = {}  # worker_id -> entry
        self._by_lease: dict[str, str] = {}  # lease_id -> worker_id
        self._watchers = Watchers(self.stats, watcher_max_queued)
        self._ids = itertools.count(1)
        # Worker ids are "<role>-<instance>-<n>": readable, and never reused by a restarted registry
        # (a gateway that watched the old one must not mistake a new worker for an old one).
        self.instance = instance if instance is not None else uuid.uuid4().hex[:4]
        self._expiry_task: asyncio.Task | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self._expiry_task = asyncio.create_task(self._expire_loop(), name="registry-expiry")

    async def close(self) -> None:
        """Stop expiring leases and end every watch; later watches end after their snapshot."""
        if self._expiry_task is not None:
            self._expiry_task.cancel()
            try:
                await self._expiry_task
            except asyncio.CancelledError:
                pass
            self._expiry_task = None
        self._watchers.close()

    async def _expire_loop(self) -> None:
        # Sweep often enough that a lease is removed within ~10% of its TTL after it runs out.
        period = min(max(self.ttl_s / 10, 0.01), 1.0)
        while True:
            await asyncio.sleep(period)
            self.expire()

    # -- worker calls --------------------------------------------------------------------------

    def register(self, worker: bootstrap_pb2.WorkerInfo) -> tuple[str, bootstrap_pb2.Lease]:
        """Add a worker; return its new worker id and lease.

        Raises InvalidWorker or RegistrationRefused. A worker already registered at the same
        grpc_address is replaced (it restarted): watchers get LEFT "replaced" then JOINED.
        """
        try:
            self._validate(worker)
            replaced = self._find_by_address(worker.grpc_address)
            self._check_consistent(worker, ignore=replaced)
        except InvalidWorker:
            self.stats.registrations_refused[REFUSED_INVALID] += 1
            raise
        except RegistrationRefused as exc:
            self.stats.registrations_refused[exc.kind] += 1
            raise
        if replaced is not None:
            self._remove(replaced, REASON_REPLACED)
        info = bootstrap_pb2.WorkerInfo()
        info.CopyFrom(worker)
        info.worker_id = f"{role_name(worker.role)}-{self.instance}-{next(self._ids)}"
        lease_id = uuid.uuid4().hex
        self._entries[info.worker_id] = _Entry(info, lease_id, self._clock() + self.ttl_s)
        self._by_lease[lease_id] = info.worker_id
        log.info("worker %s joined: model=%r grpc=%s backend=%s layout [%s]", info.worker_id, info.model,
                 info.grpc_address, info.transfer_endpoint.backend or "-", describe_layout(info.kv_layout))
        self._publish(JOINED, info)
        return info.worker_id, self._lease(lease_id)

    def heartbeat(self, lease_id: str, load: common_pb2.WorkerLoad | None = None,
                  lora_adapters: Sequence[common_pb2.LoraAdapterRef] = ()) -> bootstrap_pb2.Lease:
        """Renew a lease and record the worker's load and LoRA adapters (watchers get UPDATED if
        either changed)."""
        entry = self._entry_for_lease(lease_id)
        entry.expires_at = self._clock() + self.ttl_s
        if apply_heartbeat(entry.info, load, lora_adapters):
            self._publish(UPDATED, entry.info)
        return self._lease(lease_id)

    def deregister(self, lease_id: str) -> str:
        """Remove the worker holding `lease_id`; return its worker id."""
        entry = self._entry_for_lease(lease_id)
        self._remove(entry, REASON_DEREGISTERED)
        return entry.info.worker_id

    def expire(self) -> list[str]:
        """Remove every worker whose lease has run out; return their ids (the expiry task calls
        this periodically)."""
        now = self._clock()
        expired = [entry for entry in self._entries.values() if entry.expires_at <= now]
        for entry in expired:
            self.stats.lease_expiries += 1
            self._remove(entry, REASON_EXPIRED)
        return [entry.info.worker_id for entry in expired]

    # -- gateway calls ---------------------------------------------------------------------------

    def list(self, role: int = common_pb2.WORKER_ROLE_UNSPECIFIED, model: str = ""
             ) -> list[bootstrap_pb2.WorkerInfo]:
        """The workers registered now (copies), in registration order."""
        return [_copy(entry.info) for entry in self._entries.values() if matches(entry.info, role, model)]

    def watch(self, role: int = common_pb2.WORKER_ROLE_UNSPECIFIED, model: str = "") -> Watcher:
        """Subscribe to changes. The snapshot is queued at once, so no change between the
        snapshot and the first live event can be missed. Close the watcher when done."""
        return self._watchers.open(role, model, (entry.info for entry in self._entries.values()))

    def count_by_role(self) -> dict[str, int]:
        counts = dict.fromkeys(ROLE_NAMES.values(), 0)
        for entry in list(self._entries.values()):  # list(): metrics scrapes run on another thread
            counts[role_name(entry.info.role)] = counts.get(role_name(entry.info.role), 0) + 1
        return counts

    @property
    def num_watchers(self) -> int:
        return len(self._watchers)

    # -- internals ---------------------------------------------------------------------------

    def _lease(self, lease_id: str) -> bootstrap_pb2.Lease:
        return bootstrap_pb2.Lease(lease_id=lease_id, ttl_seconds=self.ttl_s,
                                   heartbeat_interval_seconds=self.heartbeat_interval_s)

    def _entry_for_lease(self, lease_id: str) -> _Entry:
        worker_id = self._by_lease.get(lease_id)
        if worker_id is None:
            raise LeaseNotFound(f"lease {lease_id!r} not found (expired, deregistered or replaced): "
                                f"register again")
        return self._entries[worker_id]

    def _find_by_address(self, grpc_address: str) -> _Entry | None:
        return next((e for e in self._entries.values() if e.info.grpc_address == grpc_address), None)

    @staticmethod
    def _validate(worker: bootstrap_pb2.WorkerInfo) -> None:
        validate_worker(worker)

    def _check_consistent(self, worker: bootstrap_pb2.WorkerInfo, ignore: _Entry | None) -> None:
        check_consistent(worker, [e.info for e in self._entries.values() if e is not ignore])

    def _remove(self, entry: _Entry, reason: str) -> None:
        del self._entries[entry.info.worker_id]
        del self._by_lease[entry.lease_id]
        log.info("worker %s left: %s (grpc=%s)", entry.info.worker_id, reason, entry.info.grpc_address)
        self._publish(LEFT, entry.info, reason)

    def _publish(self, event_type: bootstrap_pb2.WorkerEventType, info: bootstrap_pb2.WorkerInfo,
                 reason: str = "") -> None:
        self._watchers.publish(event_type, info, reason)


def apply_heartbeat(info: bootstrap_pb2.WorkerInfo, load: common_pb2.WorkerLoad | None,
                    lora_adapters: Sequence[common_pb2.LoraAdapterRef]) -> bool:
    """Record a heartbeat's load (when it sent one) and LoRA adapters (every heartbeat lists them
    all: a worker without adapters sends none) in `info`; return whether anything changed."""
    changed = False
    if load is not None and load != info.load:
        info.load.CopyFrom(load)
        changed = True
    if list(lora_adapters) != list(info.lora_adapters):
        del info.lora_adapters[:]
        info.lora_adapters.extend(lora_adapters)
        changed = True
    return changed


def validate_worker(worker: bootstrap_pb2.WorkerInfo) -> None:
    """Raise InvalidWorker naming every field a registration lacks or gets wrong."""
    problems = []
    if worker.role == common_pb2.WORKER_ROLE_UNSPECIFIED:
        problems.append("role is unspecified")
    elif worker.role not in common_pb2.WorkerRole.values():
        problems.append(f"role {worker.role} is not a known WorkerRole")
    if not worker.model:
        problems.append("model is empty")
    host, _, port = worker.grpc_address.rpartition(":")
    if not host or not port.isdigit():
        problems.append(f"grpc_address {worker.grpc_address!r} is not host:port")
    if not worker.HasField("kv_layout"):
        problems.append("kv_layout is missing")
    else:
        layout = worker.kv_layout
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            if getattr(layout, name) <= 0:
                problems.append(f"kv_layout.{name} must be positive, got {getattr(layout, name)}")
        if not layout.dtype:
            problems.append("kv_layout.dtype is empty")
    endpoint = worker.transfer_endpoint
    if worker.HasField("transfer_endpoint"):
        if not endpoint.backend:
            problems.append("transfer_endpoint.backend is empty")
        if (endpoint.HasField("layout") and worker.HasField("kv_layout")
                and endpoint.layout != worker.kv_layout):
            problems.append("transfer_endpoint.layout differs from kv_layout: "
                            + "; ".join(layout_differences(endpoint.layout, worker.kv_layout)))
    elif worker.role in (common_pb2.WORKER_ROLE_PREFILL, common_pb2.WORKER_ROLE_DECODE):
        problems.append(f"a {role_name(worker.role)} worker needs a transfer_endpoint")
    if problems:
        raise InvalidWorker("invalid worker registration: " + "; ".join(problems))


def check_consistent(worker: bootstrap_pb2.WorkerInfo,
                     registered: Iterable[bootstrap_pb2.WorkerInfo]) -> None:
    """Workers of one model must agree on KV layout and transfer backend, or P/D pairs of them
    would fail at their first handshake; refuse the newcomer (RegistrationRefused) with both
    values named. `registered`: the other workers (any model). Encoders (EPD) agree among
    themselves only: their layout is an embedding page and their backend the embeddings' one."""
    encoder = worker.role == common_pb2.WORKER_ROLE_ENCODER
    peers = [info for info in registered
             if info.model == worker.model and (info.role == common_pb2.WORKER_ROLE_ENCODER) == encoder]
    for peer in peers:
        diffs = layout_differences(worker.kv_layout, peer.kv_layout)
        if diffs:
            raise RegistrationRefused(
                f"KV layout mismatch for model {worker.model!r}: {'; '.join(diffs)} "
                f"(new worker at {worker.grpc_address}: {describe_layout(worker.kv_layout)}; "
                f"registered worker {peer.worker_id} at {peer.grpc_address}: "
                f"{describe_layout(peer.kv_layout)})", REFUSED_LAYOUT)
    mine = worker.transfer_endpoint.backend
    for peer in peers:
        theirs = peer.transfer_endpoint.backend
        if mine and theirs and mine != theirs:
            raise RegistrationRefused(
                f"transfer backend mismatch for model {worker.model!r}: {mine} vs {theirs} "
                f"(new worker at {worker.grpc_address} vs registered worker {peer.worker_id} "
                f"at {peer.grpc_address})", REFUSED_BACKEND)


def _copy(info: bootstrap_pb2.WorkerInfo) -> bootstrap_pb2.WorkerInfo:
    out = bootstrap_pb2.WorkerInfo()
    out.CopyFrom(info)
    return out
