"""WorkerCache: one registry process's view of the workers in etcd, kept current by one etcd watch.

Filled by one Range and kept current by one etcd watch from the Range's revision on, so no change
between the two is lost; each change is fanned out to the process's Watch streams
(services.bootstrap.watchers) exactly as the in-memory registry does (snapshot, SYNCED, changes).
A broken or compacted etcd watch reads the workers again and watches from that read (so an etcd
restarted on a wiped data dir, whose revisions start again from 1, is followed too). While it is
broken this process cannot vouch for its view (`healthy` is False): the store then ends its Watch
streams with UNAVAILABLE and refuses new ones, so gateways move to a registry process that still
follows etcd.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from protos.etcd import rpc_pb2
from protos.v1 import bootstrap_pb2
from services.bootstrap.etcd_client import EtcdClient
from services.bootstrap.etcd_records import REASON_UNREADABLE, RecordReader
from services.bootstrap.registry import REASON_EXPIRED
from services.bootstrap.watchers import (
    JOINED,
    LEFT,
    UPDATED,
    RegistryStats,
    StoreUnavailable,
    Watchers,
    role_name,
)

log = logging.getLogger("pdserve.bootstrap")


class WorkerCache:
    """The workers under `records.prefix` as this process last saw them, in registration order, and
    the etcd watch that keeps them current (module doc). Used on one event loop: `start()` with the
    first Range, `close()` when the store closes. `health_changed(healthy)` is called whenever the
    watch goes down or comes back."""

    def __init__(self, client: EtcdClient, records: RecordReader, watchers: Watchers, stats: RegistryStats,
                 health_changed: Callable[[bool], None]) -> None:
        self.client = client
        self.records = records
        self._watchers = watchers
        self._stats = stats
        self._health_changed = health_changed
        self._workers: dict[bytes, tuple[int, bootstrap_pb2.WorkerInfo]] = {}  # key -> (create rev, info)
        self._following = False  # whether the etcd watch is up (the cache is current)
        self._task: asyncio.Task | None = None

    @property
    def healthy(self) -> bool:
        return self._following

    def start(self, first: rpc_pb2.RangeResponse) -> None:
        """Take the workers of the first Range (nothing published: no watch is open yet) and watch
        etcd from the revision after it."""
        self._reconcile(first, publish=False)
        self._following = True
        self._task = asyncio.create_task(self._watch_loop(first.header.revision + 1),
                                         name="registry-etcd-watch")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def workers(self) -> list[bootstrap_pb2.WorkerInfo]:
        """The cached workers, in registration order."""
        return [info for _, info in sorted(self._workers.values(), key=lambda item: item[0])]

    def count_by_role(self) -> dict[str, int]:
        counts = {"prefill": 0, "decode": 0, "colocated": 0}
        for _, info in list(self._workers.values()):  # list(): metrics scrapes run on another thread
            counts[role_name(info.role)] = counts.get(role_name(info.role), 0) + 1
        return counts

    def _set_following(self, following: bool) -> None:
        if following != self._following:
            self._following = following
            self._health_changed(following)

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
                async for response in self.client.watch_prefix(self.records.prefix, revision):
                    if response.created and not self._following:
                        log.info("etcd watch on %s back from revision %d", self.client.address, revision)
                        self._set_following(True)
                    if response.compact_revision or response.canceled:
                        log.warning("etcd watch from revision %d ended (%s); reading the workers again",
                                    revision,
                                    response.cancel_reason or f"compacted to {response.compact_revision}")
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
        response = await self.client.range_prefix(self.records.prefix)
        self._reconcile(response, publish=True)
        return response.header.revision + 1

    def _reconcile(self, response: rpc_pb2.RangeResponse, *, publish: bool) -> None:
        fresh = {kv.key: (kv.create_revision, stored.worker)
                 for kv, stored in self.records.live(response.kvs)}
        old, self._workers = self._workers, fresh
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
            gone = self._workers.pop(key, None)
            if gone is not None:  # deleted with no left_reason first: its lease ran out
                self._stats.lease_expiries += 1
                log.info("worker %s left: %s (grpc=%s)", gone[1].worker_id, REASON_EXPIRED,
                         gone[1].grpc_address)
                self._publish(LEFT, gone[1], REASON_EXPIRED)
            return
        stored = self.records.decode(event.kv)
        if stored is None or stored.left_reason:
            gone = self._workers.pop(key, None)
            if gone is not None:
                reason = stored.left_reason if stored is not None else REASON_UNREADABLE
                log.info("worker %s left: %s (grpc=%s)", gone[1].worker_id, reason, gone[1].grpc_address)
                self._publish(LEFT, gone[1], reason)
            return
        previous = self._workers.get(key)
        self._workers[key] = (event.kv.create_revision, stored.worker)
        if previous is None:
            self._publish(JOINED, stored.worker)
        elif previous[1] != stored.worker:
            self._publish(UPDATED, stored.worker)

    def _publish(self, event_type: bootstrap_pb2.WorkerEventType, info: bootstrap_pb2.WorkerInfo,
                 reason: str = "") -> None:
        self._watchers.publish(event_type, info, reason)
