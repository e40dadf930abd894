"""EtcdStore: the registry's workers in etcd, shared by any number of registry processes.

Layout: one key per worker, `/pdserve/<cluster>/workers/<worker_id>`, whose value is a
pdserve.v1.StoredWorker (the WorkerInfo, the lease token, and a left_reason on its last write),
attached to the worker's own etcd lease (services.bootstrap.etcd_records).

- Register: grant an etcd lease of the registry's TTL (heartbeat interval x max failures), then in
  one etcd transaction check the model's layout/backend agreement against the workers in etcd and
  put the record; the transaction holds only if no worker key was created since those workers
  were read, so two registry processes can never admit disagreeing workers. The worker id is
  "<role>-<etcd lease id in hex>" (unique in the etcd cluster, stable across registry processes).
- Lease.lease_id handed to the worker is "<worker_id>:<token>"; the token is random and stored in
  the record, so guessing etcd's sequential lease ids gains nothing.
- Heartbeat: an etcd lease keep-alive, plus a put when the load or the LoRA adapters changed.
  Through any registry process: a worker that fails over keeps its id and lease.
- Deregister / replaced: the record is rewritten with left_reason, then its lease revoked. A record
  deleted without one ran out of lease: etcd expires it, not this process.
- Watch: each process keeps a cache of the workers, filled by one Range and kept current by one
  etcd watch from the Range's revision on (services.bootstrap.etcd_cache); it fans out to the
  process's Watch streams exactly as the in-memory registry does (snapshot, SYNCED, changes).
  While that etcd watch is broken this process cannot vouch for its view: its Watch streams end
  with UNAVAILABLE and new ones are refused, so gateways move to a registry process that still
  follows etcd.
- List reads etcd itself, so it is as current as etcd, whichever process answers.

Records that do not parse, sit under a malformed key, name another worker id or fail validation
(written by hand or by a broken client) are skipped with a warning, never served.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import secrets
from collections.abc import Callable, Sequence

import grpc

from protos.etcd import rpc_pb2
from protos.v1 import bootstrap_pb2, common_pb2, registry_store_pb2
from services.bootstrap.etcd_cache import WorkerCache
from services.bootstrap.etcd_client import EtcdClient, prefix_end
from services.bootstrap.etcd_records import WORKER_ID, RecordReader, workers_prefix
from services.bootstrap.registry import (
    REASON_DEREGISTERED,
    REASON_REPLACED,
    REFUSED_INVALID,
    InvalidWorker,
    LeaseNotFound,
    RegistrationRefused,
    apply_heartbeat,
    check_consistent,
    describe_layout,
    validate_worker,
)
from services.bootstrap.watchers import RegistryStats, StoreUnavailable, Watcher, Watchers, matches, role_name

log = logging.getLogger("pdserve.bootstrap")

_TXN_ATTEMPTS = 16  # registrations racing on one etcd retry this often before giving up


class EtcdStore:
    """RegistryStore on etcd (see the module docstring). Created and used on one event loop;
    `start()` reads the workers and starts the etcd watch, `close()` stops it and ends every watch."""

    def __init__(self, client: EtcdClient, *, cluster: str, heartbeat_interval_s: float,
                 heartbeat_max_failure: int, watcher_max_queued: int = 1024,
                 connect_timeout_s: float = 10.0) -> None:
        if heartbeat_interval_s <= 0 or heartbeat_max_failure < 1:
            raise ValueError(f"heartbeat interval must be > 0 and max failures >= 1, got "
                             f"{heartbeat_interval_s} and {heartbeat_max_failure}")
        if not cluster or "/" in cluster:
            raise ValueError(f"cluster name must be non-empty and without '/', got {cluster!r}")
        self.client = client
        self.cluster = cluster
        self.prefix = workers_prefix(cluster)
        self.heartbeat_interval_s = heartbeat_interval_s
        # etcd leases are whole seconds, and etcd raises very short ones to its minimum (about 2 s;
        # the Lease a worker gets says what etcd granted)
        self._lease_ttl = max(1, math.ceil(heartbeat_interval_s * heartbeat_max_failure))
        self.ttl_s = float(self._lease_ttl)
        self.watcher_max_queued = watcher_max_queued
        self.connect_timeout_s = connect_timeout_s
        self.stats = RegistryStats()
        self._records = RecordReader(self.prefix)
        self._watchers = Watchers(self.stats, watcher_max_queued)
        self._cache = WorkerCache(client, self._records, self._watchers, self.stats, self._health_changed)
        # called with the new value of `healthy` when it changes (the gRPC health status follows it)
        self.on_health_change: Callable[[bool], None] | None = None

    @property
    def healthy(self) -> bool:
        """Whether the etcd watch is up, so the cache (what Watch streams are fed from) is current."""
        return self._cache.healthy

    def _health_changed(self, healthy: bool) -> None:
        if self.on_health_change is not None:
            self.on_health_change(healthy)

    def describe(self) -> str:
        return f"etcd store at {self.client.address} under {self.prefix.decode()}"

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the workers (waiting up to connect_timeout_s for etcd) and start watching."""
        deadline = asyncio.get_running_loop().time() + self.connect_timeout_s
        while True:
            try:
                response = await self.client.range_prefix(self.prefix)
                break
            except grpc.aio.AioRpcError as exc:
                if asyncio.get_running_loop().time() >= deadline:
                    raise ConnectionError(f"etcd at {self.client.address} unreachable for "
                                          f"{self.connect_timeout_s:g}s: {exc.code().name} {exc.details()}"
                                          ) from exc
                await asyncio.sleep(0.5)
        self._cache.start(response)

    async def close(self) -> None:
        await self._cache.close()
        self._watchers.close()
        await self.client.close()

    # -- worker calls --------------------------------------------------------------------------

    async def register(self, worker: bootstrap_pb2.WorkerInfo) -> tuple[str, bootstrap_pb2.Lease]:
        try:
            validate_worker(worker)
        except InvalidWorker:
            self.stats.registrations_refused[REFUSED_INVALID] += 1
            raise
        try:
            grant = await self.client.grant(self._lease_ttl)
        except grpc.aio.AioRpcError as exc:
            raise _unavailable(exc) from exc
        info = bootstrap_pb2.WorkerInfo()
        info.CopyFrom(worker)
        info.worker_id = f"{role_name(worker.role)}-{grant.ID:x}"
        record = registry_store_pb2.StoredWorker(worker=info, lease_token=secrets.token_hex(16))
        try:
            replaced = await self._put_consistent(record, grant.ID)
        except RegistrationRefused as exc:
            self.stats.registrations_refused[exc.kind] += 1
            await self._revoke_quietly(grant.ID)
            raise
        except BaseException:
            await self._revoke_quietly(grant.ID)
            raise
        if replaced is not None:
            await self._revoke_quietly(replaced.lease)
        log.info("worker %s joined: model=%r grpc=%s backend=%s layout [%s] (etcd lease %x, ttl %ds)",
                 info.worker_id, info.model, info.grpc_address, info.transfer_endpoint.backend or "-",
                 describe_layout(info.kv_layout), grant.ID, grant.TTL)
        return info.worker_id, self._lease(f"{info.worker_id}:{record.lease_token}", grant.TTL)

    async def _put_consistent(self, record: registry_store_pb2.StoredWorker, lease: int
                              ) -> rpc_pb2.KeyValue | None:
        """Put `record` if its model's workers in etcd agree with it, atomically; a worker at the
        same grpc_address is marked replaced in the same transaction. Returns the replaced key."""
        info = record.worker
        key = self.prefix + info.worker_id.encode()
        for _ in range(_TXN_ATTEMPTS):
            try:
                current = await self.client.range_prefix(self.prefix)
            except grpc.aio.AioRpcError as exc:
                raise _unavailable(exc) from exc
            live = self._records.live(current.kvs)
            replaced = next(((kv, stored) for kv, stored in live
                             if stored.worker.grpc_address == info.grpc_address), None)
            check_consistent(info, [stored.worker for kv, stored in live
                                    if replaced is None or kv.key != replaced[0].key])
            # Holds only if no worker key was created after the read above: a racing registration
            # through another registry process makes this one re-read and re-check.
            compares = [rpc_pb2.Compare(result=rpc_pb2.Compare.LESS, target=rpc_pb2.Compare.CREATE,
                                        key=self.prefix, range_end=prefix_end(self.prefix),
                                        create_revision=current.header.revision + 1)]
            ops = []
            if replaced is not None:
                old_kv, old = replaced
                compares.append(rpc_pb2.Compare(result=rpc_pb2.Compare.EQUAL, target=rpc_pb2.Compare.MOD,
                                                key=old_kv.key, mod_revision=old_kv.mod_revision))
                old.left_reason = REASON_REPLACED
                ops.append(rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(
                    key=old_kv.key, value=old.SerializeToString(), ignore_lease=True)))
            ops.append(rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(
                key=key, value=record.SerializeToString(), lease=lease)))
            try:
                txn = await self.client.txn(rpc_pb2.TxnRequest(compare=compares, success=ops))
            except grpc.aio.AioRpcError as exc:
                raise _unavailable(exc) from exc
            if txn.succeeded:
                return replaced[0] if replaced is not None else None
            log.debug("registration of %s raced another write; reading the workers again", info.grpc_address)
        raise StoreUnavailable(f"registration of {info.grpc_address} kept racing other registrations "
                               f"({_TXN_ATTEMPTS} tries): try again")

    async def heartbeat(self, lease_id: str, load: common_pb2.WorkerLoad | None = None,
                        lora_adapters: Sequence[common_pb2.LoraAdapterRef] = ()) -> bootstrap_pb2.Lease:
        kv, record = await self._lookup(lease_id)
        try:
            ttl = await self.client.keep_alive(kv.lease)
        except grpc.aio.AioRpcError as exc:
            raise _unavailable(exc) from exc
        if ttl <= 0:
            raise LeaseNotFound(f"lease {lease_id!r} expired: register again")
        if apply_heartbeat(record.worker, load, lora_adapters):
            # Lost to a concurrent write (deregister, another heartbeat): the next beat sends it again.
            await self._put_if_unchanged(kv, record)
        return self._lease(lease_id, ttl)

    async def deregister(self, lease_id: str) -> str:
        for _ in range(_TXN_ATTEMPTS):
            kv, record = await self._lookup(lease_id)
            record.left_reason = REASON_DEREGISTERED
            if await self._put_if_unchanged(kv, record):
                await self._revoke_quietly(kv.lease)
                return record.worker.worker_id
        raise StoreUnavailable(f"deregistration of {lease_id.partition(':')[0]} kept racing other writes")

    async def _put_if_unchanged(self, kv: rpc_pb2.KeyValue, record: registry_store_pb2.StoredWorker) -> bool:
        try:
            txn = await self.client.txn(rpc_pb2.TxnRequest(
                compare=[rpc_pb2.Compare(result=rpc_pb2.Compare.EQUAL, target=rpc_pb2.Compare.MOD,
                                         key=kv.key, mod_revision=kv.mod_revision)],
                success=[rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(
                    key=kv.key, value=record.SerializeToString(), ignore_lease=True))]))
        except grpc.aio.AioRpcError as exc:
            raise _unavailable(exc) from exc
        return txn.succeeded

    async def _lookup(self, lease_id: str) -> tuple[rpc_pb2.KeyValue, registry_store_pb2.StoredWorker]:
        not_found = LeaseNotFound(f"lease {lease_id!r} not found (expired, deregistered or replaced): "
                                  f"register again")
        worker_id, _, token = lease_id.partition(":")
        if not WORKER_ID.fullmatch(worker_id) or not token:
            raise not_found
        try:
            kv = await self.client.get(self.prefix + worker_id.encode())
        except grpc.aio.AioRpcError as exc:
            raise _unavailable(exc) from exc
        record = self._records.decode(kv) if kv is not None else None
        if (kv is None or record is None or record.left_reason
                or not hmac.compare_digest(record.lease_token.encode(), token.encode())):
            raise not_found
        return kv, record

    async def _revoke_quietly(self, lease: int) -> None:
        try:
            await self.client.revoke(lease)
        except grpc.aio.AioRpcError as exc:  # it expires by itself within one TTL
            log.warning("revoking etcd lease %x failed (%s %s); it expires within %ds", lease,
                        exc.code().name, exc.details(), self._lease_ttl)

    def _lease(self, lease_id: str, ttl_s: int) -> bootstrap_pb2.Lease:
        return bootstrap_pb2.Lease(lease_id=lease_id, ttl_seconds=float(ttl_s),
                                   heartbeat_interval_seconds=self.heartbeat_interval_s)

    # -- gateway calls ---------------------------------------------------------------------------

    async def list(self, role: int = common_pb2.WORKER_ROLE_UNSPECIFIED, model: str = ""
                   ) -> list[bootstrap_pb2.WorkerInfo]:
        """The workers in etcd now, in registration order."""
        try:
            response = await self.client.range_prefix(self.prefix)
        except grpc.aio.AioRpcError as exc:
            raise _unavailable(exc) from exc
        live = sorted((kv.create_revision, stored.worker) for kv, stored in self._records.live(response.kvs))
        return [info for _, info in live if matches(info, role, model)]

    def watch(self, role: int = common_pb2.WORKER_ROLE_UNSPECIFIED, model: str = "") -> Watcher:
        """Subscribe to changes: the cached workers now, SYNCED, then every change (as Registry.watch)."""
        if not self._cache.healthy:
            raise StoreUnavailable(f"this registry lost its etcd watch ({self.client.address}): "
                                   f"watch through another registry")
        return self._watchers.open(role, model, self._cache.workers())

    def count_by_role(self) -> dict[str, int]:
        return self._cache.count_by_role()

    @property
    def num_watchers(self) -> int:
        return len(self._watchers)


def _unavailable(exc: grpc.aio.AioRpcError) -> StoreUnavailable:
    return StoreUnavailable(f"etcd unreachable: {exc.code().name} {exc.details()}")
