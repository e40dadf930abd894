"""EtcdStore: the registry's workers in etcd, shared by any number of registry processes.

Layout: one key per worker, `/pdserve/<cluster>/workers/<worker_id>`, whose value is a
pdserve.v1.StoredWorker (the WorkerInfo, the lease token, and a left_reason on its last write),
attached to the worker's own etcd lease.

- Register: grant an etcd lease of the registry's TTL (heartbeat interval x max failures), then in
  one etcd transaction check the model's layout/backend agreement against the workers in etcd and
  put the record; the transaction holds only if no worker key was created since those workers
  were read, so two registry processes can never admit disagreeing workers. The worker id is
  "<role>-<etcd lease id in hex>" (unique in the etcd cluster, stable across registry processes).
- Lease.lease_id handed to the worker is "<worker_id>:<token>"; the token is random and stored in
  the record, so guessing etcd's sequential lease ids gains nothing.
- Heartbeat: an etcd lease keep-alive, plus a put when the load changed. Through any registry
  process: a worker that fails over keeps its id and lease.
- Deregister / replaced: the record is rewritten with left_reason, then its lease revoked. A record
  deleted without one ran out of lease: etcd expires it, not this process.
- Watch: each process keeps a cache of the workers, filled by one Range and kept current by one
  etcd watch from the Range's revision on, so no change between the two is lost; it fans out to
  the process's Watch streams exactly as the in-memory registry does (snapshot, SYNCED, changes).
  A broken or compacted etcd watch reads the workers again and watches from that read (so an
  etcd restarted on a wiped data dir, whose revisions start again from 1, is followed too). While
  it is broken this process cannot vouch for its view: its Watch streams end with UNAVAILABLE and
  new ones are refused, so gateways move to a registry process that still follows etcd.
- List reads etcd itself, so it is as current as etcd, whichever process answers.

Records that do not parse, sit under a malformed key, name another worker id or fail validation
(written by hand or by a broken client) are skipped with a warning, never served.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import re
import secrets
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError

from protos.etcd import rpc_pb2
from protos.v1 import bootstrap_pb2, common_pb2, registry_store_pb2
from services.bootstrap.etcd_client import EtcdClient, prefix_end
from services.bootstrap.registry import (
    REASON_DEREGISTERED,
    REASON_EXPIRED,
    REASON_REPLACED,
    REFUSED_INVALID,
    InvalidWorker,
    LeaseNotFound,
    RegistrationRefused,
    check_consistent,
    describe_layout,
    validate_worker,
)
from services.bootstrap.watchers import (
    JOINED,
    LEFT,
    UPDATED,
    RegistryStats,
    StoreUnavailable,
    Watcher,
    Watchers,
    matches,
    role_name,
)

log = logging.getLogger("pdserve.bootstrap")

REASON_UNREADABLE = "record unreadable"
_WORKER_ID = re.compile(r"[a-z]+-[0-9a-f]{1,16}")
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
        self.prefix = f"/pdserve/{cluster}/workers/".encode()
        self.heartbeat_interval_s = heartbeat_interval_s
        # etcd leases are whole seconds, and etcd raises very short ones to its minimum (about 2 s;
        # the Lease a worker gets says what etcd granted)
        self._lease_ttl = max(1, math.ceil(heartbeat_interval_s * heartbeat_max_failure))
        self.ttl_s = float(self._lease_ttl)
        self.watcher_max_queued = watcher_max_queued
        self.connect_timeout_s = connect_timeout_s
        self.stats = RegistryStats()
        self._cache: dict[bytes, tuple[int, bootstrap_pb2.WorkerInfo]] = {}  # key -> (create rev, info)
        self._watchers = Watchers(self.stats, watcher_max_queued)
        self._warned: set[tuple[bytes, int]] = set()
        self._watch_task: asyncio.Task | None = None
        self._following = False  # whether the etcd watch is up (the cache is current)
        # called with the new value of `healthy` when it changes (the gRPC health status follows it)
        self.on_health_change: Callable[[bool], None] | None = None

    @property
    def healthy(self) -> bool:
        return self._following

    def _set_following(self, following: bool) -> None:
        if following != self._following:
            self._following = following
            if self.on_health_change is not None:
                self.on_health_change(following)

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
        self._reconcile(response, publish=False)
        self._following = True
        self._watch_task = asyncio.create_task(self._watch_loop(response.header.revision + 1),
                                               name="registry-etcd-watch")

    async def close(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
            try:
                await self._watch_task
            except asyncio.CancelledError:
                pass
            self._watch_task = None
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
            live = [(kv, stored) for kv in current.kvs
                    if (stored := self._decode(kv)) is not None and not stored.left_reason]
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

    async def heartbeat(self, lease_id: str, load: common_pb2.WorkerLoad | None = None) -> bootstrap_pb2.Lease:
        kv, record = await self._lookup(lease_id)
        try:
            ttl = await self.client.keep_alive(kv.lease)
        except grpc.aio.AioRpcError as exc:
            raise _unavailable(exc) from exc
        if ttl <= 0:
            raise LeaseNotFound(f"lease {lease_id!r} expired: register again")
        if load is not None and load != record.worker.load:
            record.worker.load.CopyFrom(load)
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
        if not _WORKER_ID.fullmatch(worker_id) or not token:
            raise not_found
        try:
            kv = await self.client.get(self.prefix + worker_id.encode())
        except grpc.aio.AioRpcError as exc:
            raise _unavailable(exc) from exc
        record = self._decode(kv) if kv is not None else None
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
        live = sorted((kv.create_revision, stored.worker) for kv in response.kvs
                      if (stored := self._decode(kv)) is not None and not stored.left_reason)
        return [info for _, info in live if matches(info, role, model)]

    def watch(self, role: int = common_pb2.WORKER_ROLE_UNSPECIFIED, model: str = "") -> Watcher:
        """Subscribe to changes: the cached workers now, SYNCED, then every change (as Registry.watch)."""
        if not self._following:
            raise StoreUnavailable(f"this registry lost its etcd watch ({self.client.address}): "
                                   f"watch through another registry")
        in_order = sorted(self._cache.values(), key=lambda item: item[0])
        return self._watchers.open(role, model, (info for _, info in in_order))

    def count_by_role(self) -> dict[str, int]:
        counts = {"prefill": 0, "decode": 0, "colocated": 0}
        for _, info in list(self._cache.values()):  # list(): metrics scrapes run on another thread
            counts[role_name(info.role)] = counts.get(role_name(info.role), 0) + 1
        return counts

    @property
    def num_watchers(self) -> int:
        return len(self._watchers)

    # -- the cache and its etcd watch -------------------------------------------------------------

    async def _watch_loop(self, revision: int) -> None:
        """Follow etcd for as long as the store is open: never ends on an error. A broken or
        compacted watch reads the workers again (one Range, reconciled into the cache and published
        as changes) and watches from that read's revision, with backoff while etcd is away. Reading
        again rather than resuming from the last revision seen also heals an etcd restarted on a
        wiped or restored data dir, whose revisions went backwards: a watch from the old revision
        would wait for a future one and miss every worker that registers meanwhile."""
        backoff_s = 0.1
        resync = False
        while True:
            try:
                if resync:
                    revision = await self._read_all()
                    resync = False
                async for response in self.client.watch_prefix(self.prefix, revision):
                    if response.created and not self._following:
                        log.info("etcd watch on %s back from revision %d", self.client.address, revision)
                        self._set_following(True)
                    if response.compact_revision or response.canceled:
                        log.warning("etcd watch from revision %d ended (%s); reading the workers again",
                                    revision, response.cancel_reason or f"compacted to {response.compact_revision}")
                        resync = True
                        break
                    for event in response.events:
                        self._apply(event)
                        revision = max(revision, event.kv.mod_revision + 1)
                    backoff_s = 0.1
                else:
                    resync = True  # etcd ended the stream (shutting down): read again when it is back
            except grpc.aio.AioRpcError as exc:
                self._lose_etcd(f"{exc.code().name} {exc.details()}")
                resync = True
                self.client.next_member()
            except Exception as exc:  # noqa: BLE001 - a registry that stops following etcd must not go quiet
                log.exception("etcd watch on %s failed", self.client.address)
                self._lose_etcd(repr(exc))
                resync = True
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, 2.0)

    def _lose_etcd(self, why: str) -> None:
        if self._following:
            log.warning("etcd watch on %s broke: %s; ending this registry's watches until etcd answers "
                        "again", self.client.address, why)
            self._set_following(False)
            self._watchers.fail(StoreUnavailable(f"registry lost its etcd watch: {why}: watch again"))

    async def _read_all(self) -> int:
        """Read every worker from etcd into the cache (publishing the differences); return the
        revision to watch from."""
        response = await self.client.range_prefix(self.prefix)
        self._reconcile(response, publish=True)
        return response.header.revision + 1

    def _reconcile(self, response: rpc_pb2.RangeResponse, *, publish: bool) -> None:
        fresh: dict[bytes, tuple[int, bootstrap_pb2.WorkerInfo]] = {}
        for kv in response.kvs:
            stored = self._decode(kv)
            if stored is not None and not stored.left_reason:
                fresh[kv.key] = (kv.create_revision, stored.worker)
        old, self._cache = self._cache, fresh
        if not publish:
            return
        for key, (_, info) in old.items():
            if key not in fresh:
                self._publish(LEFT, info, REASON_EXPIRED)
        for key, (_, info) in fresh.items():
            if key not in old:
                self._publish(JOINED, info)
            elif old[key][1] != info:
                self._publish(UPDATED, info)

    def _apply(self, event: rpc_pb2.Event) -> None:
        key = event.kv.key
        if event.type == rpc_pb2.Event.DELETE:
            gone = self._cache.pop(key, None)
            if gone is not None:  # deleted with no left_reason first: its lease ran out
                self.stats.lease_expiries += 1
                log.info("worker %s left: %s (grpc=%s)", gone[1].worker_id, REASON_EXPIRED, gone[1].grpc_address)
                self._publish(LEFT, gone[1], REASON_EXPIRED)
            return
        stored = self._decode(event.kv)
        if stored is None or stored.left_reason:
            gone = self._cache.pop(key, None)
            if gone is not None:
                reason = stored.left_reason if stored is not None else REASON_UNREADABLE
                log.info("worker %s left: %s (grpc=%s)", gone[1].worker_id, reason, gone[1].grpc_address)
                self._publish(LEFT, gone[1], reason)
            return
        previous = self._cache.get(key)
        self._cache[key] = (event.kv.create_revision, stored.worker)
        if previous is None:
            self._publish(JOINED, stored.worker)
        elif previous[1] != stored.worker:
            self._publish(UPDATED, stored.worker)

    def _decode(self, kv: rpc_pb2.KeyValue) -> registry_store_pb2.StoredWorker | None:
        """The record under `kv`, or None (with one warning per key and revision) if it is not one
        this registry would have written."""
        problem = None
        worker_id = kv.key[len(self.prefix):].decode("utf-8", "replace")
        record = registry_store_pb2.StoredWorker()
        if not kv.key.startswith(self.prefix) or not _WORKER_ID.fullmatch(worker_id):
            problem = "malformed key"
        else:
            try:
                record.ParseFromString(kv.value)
                if record.worker.worker_id != worker_id:
                    problem = f"record names worker {record.worker.worker_id!r}"
                elif not record.lease_token:
                    problem = "no lease token"
                else:
                    validate_worker(record.worker)
            except DecodeError as exc:
                problem = f"not a StoredWorker ({exc})"
            except InvalidWorker as exc:
                problem = str(exc)
        if problem is None:
            return record
        if (kv.key, kv.mod_revision) not in self._warned:
            if len(self._warned) > 10_000:
                self._warned.clear()
            self._warned.add((kv.key, kv.mod_revision))
            log.warning("ignoring etcd key %r: %s", kv.key[:200], problem)
        return None

    def _publish(self, event_type: bootstrap_pb2.WorkerEventType, info: bootstrap_pb2.WorkerInfo, reason: str = "") -> None:
        self._watchers.publish(event_type, info, reason)


def _unavailable(exc: grpc.aio.AioRpcError) -> StoreUnavailable:
    return StoreUnavailable(f"etcd unreachable: {exc.code().name} {exc.details()}")
