"""The registry's worker records in etcd: where they live and how a value is read back.

One key per worker, `/pdserve/<cluster>/workers/<worker_id>`, whose value is a
pdserve.v1.StoredWorker (the WorkerInfo, the lease token, and a left_reason on its last write). The
worker id is "<role>-<etcd lease id in hex>". Records that do not parse, sit under a malformed
key, name another worker id or fail validation (written by hand or by a broken client) are
skipped with a warning, never served.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

from google.protobuf.message import DecodeError

from protos.etcd import rpc_pb2
from protos.v1 import registry_store_pb2
from services.bootstrap.registry import InvalidWorker, validate_worker

log = logging.getLogger("pdserve.bootstrap")

REASON_UNREADABLE = "record unreadable"  # the LEFT reason of a worker whose record stopped parsing
WORKER_ID = re.compile(r"[a-z]+-[0-9a-f]{1,16}")
_WARNED_MAX = 10_000  # (key, revision) pairs remembered so each bad record is warned about once


def workers_prefix(cluster: str) -> bytes:
    """The key prefix of every worker record of `cluster` (a name without '/')."""
    return f"/pdserve/{cluster}/workers/".encode()


class RecordReader:
    """Reads the worker records under `prefix`; a value it skips is warned about once per key and
    revision (a watch and every List see it again)."""

    def __init__(self, prefix: bytes) -> None:
        self.prefix = prefix
        self._warned: set[tuple[bytes, int]] = set()

    def live(self, kvs: Iterable[rpc_pb2.KeyValue]
             ) -> list[tuple[rpc_pb2.KeyValue, registry_store_pb2.StoredWorker]]:
        """The readable records of workers that have not left, with their key-values."""
        return [(kv, stored) for kv in kvs
                if (stored := self.decode(kv)) is not None and not stored.left_reason]

    def decode(self, kv: rpc_pb2.KeyValue) -> registry_store_pb2.StoredWorker | None:
        """The record under `kv`, or None (with one warning per key and revision) if it is not one
        this registry would have written."""
        problem = None
        worker_id = kv.key[len(self.prefix):].decode("utf-8", "replace")
        record = registry_store_pb2.StoredWorker()
        if not kv.key.startswith(self.prefix) or not WORKER_ID.fullmatch(worker_id):
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
            if len(self._warned) > _WARNED_MAX:
                self._warned.clear()
            self._warned.add((kv.key, kv.mod_revision))
            log.warning("ignoring etcd key %r: %s", kv.key[:200], problem)
        return None
