"""RegistryStore: where the registry keeps its workers, as the Bootstrap servicer sees it.

Two implementations with one set of semantics (those of protos/v1/bootstrap.proto):
- MemoryStore (the default): registry.Registry in this process; one registry process per cluster.
- etcd_store.EtcdStore: records under etcd leases; any number of registry processes on one etcd
  give every client the same workers, and a worker may heartbeat through any of them.

Errors are registry.py's exceptions (InvalidWorker, RegistrationRefused, LeaseNotFound) and
watchers.py's (WatcherOverflow, StoreUnavailable); the servicer maps them to status codes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from protos.v1 import bootstrap_pb2, common_pb2
from services.bootstrap.registry import Registry
from services.bootstrap.watchers import RegistryStats, Watcher

ANY_ROLE = common_pb2.WORKER_ROLE_UNSPECIFIED


class RegistryStore(Protocol):
    """What the servicer and the metrics collector use. `start()` before serving, `close()` after
    (it ends every open watch)."""

    @property
    def stats(self) -> RegistryStats: ...

    @property
    def ttl_s(self) -> float: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def register(self, worker: bootstrap_pb2.WorkerInfo) -> tuple[str, bootstrap_pb2.Lease]: ...

    async def heartbeat(self, lease_id: str, load: common_pb2.WorkerLoad | None = None,
                        lora_adapters: Sequence[common_pb2.LoraAdapterRef] = ()) -> bootstrap_pb2.Lease: ...

    async def deregister(self, lease_id: str) -> str: ...

    async def list(self, role: int = ANY_ROLE, model: str = "") -> list[bootstrap_pb2.WorkerInfo]: ...

    def watch(self, role: int = ANY_ROLE, model: str = "") -> Watcher: ...

    def count_by_role(self) -> dict[str, int]: ...

    @property
    def num_watchers(self) -> int: ...

    @property
    def healthy(self) -> bool:
        """Whether this process's view of the workers is current (etcd: its etcd watch is up)."""
        ...

    def describe(self) -> str:
        """One phrase for the ready line, e.g. "in-memory store"."""
        ...


class MemoryStore:
    """The in-process Registry behind the RegistryStore interface."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    @property
    def stats(self) -> RegistryStats:
        return self.registry.stats

    @property
    def ttl_s(self) -> float:
        return self.registry.ttl_s

    async def start(self) -> None:
        await self.registry.start()

    async def close(self) -> None:
        await self.registry.close()

    async def register(self, worker: bootstrap_pb2.WorkerInfo) -> tuple[str, bootstrap_pb2.Lease]:
        return self.registry.register(worker)

    async def heartbeat(self, lease_id: str, load: common_pb2.WorkerLoad | None = None,
                        lora_adapters: Sequence[common_pb2.LoraAdapterRef] = ()) -> bootstrap_pb2.Lease:
        return self.registry.heartbeat(lease_id, load, lora_adapters)

    async def deregister(self, lease_id: str) -> str:
        return self.registry.deregister(lease_id)

    async def list(self, role: int = ANY_ROLE, model: str = "") -> list[bootstrap_pb2.WorkerInfo]:
        return self.registry.list(role, model)

    def watch(self, role: int = ANY_ROLE, model: str = "") -> Watcher:
        return self.registry.watch(role, model)

    def count_by_role(self) -> dict[str, int]:
        return self.registry.count_by_role()

    @property
    def num_watchers(self) -> int:
        return self.registry.num_watchers

    @property
    def healthy(self) -> bool:
        return True

    def describe(self) -> str:
        return "in-memory store"
