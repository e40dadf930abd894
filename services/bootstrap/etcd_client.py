"""EtcdClient: the few etcd v3 calls the registry's etcd store makes, over grpcio.

etcd's own gRPC API (protos/etcd/rpc.proto, a wire-compatible subset) rather than a PyPI etcd
library: the maintained ones do not exist, and the old `etcd3` breaks with current protobuf.

Endpoints: several may be given (`http://a:2379,http://b:2379`, members of one etcd cluster); a
call that finds its member unreachable is tried once on each of the others before it fails.
Errors stay grpc.aio.AioRpcError: the store decides what they mean for its callers.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc

from protos.etcd import rpc_pb2, rpc_pb2_grpc

log = logging.getLogger("pdserve.bootstrap.etcd")

# Codes after which another member may succeed (the one asked is down or cut off).
_FAILOVER_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

# Ping etcd so a member that froze or sits behind a network cut breaks the watch stream (which would
# otherwise wait forever). etcd answers pings more often than --grpc-keepalive-min-time (5 s by
# default) or on a connection without streams with GOAWAY, hence 10 s and only while calls are open
# (the store's watch always is).
_CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


def parse_endpoints(endpoints: str) -> list[str]:
    """`http://127.0.0.1:2379,127.0.0.1:22379` -> ["127.0.0.1:2379", "127.0.0.1:22379"]; raises
    ValueError naming an endpoint that is not [http://]host:port (https needs TLS: not supported)."""
    parsed = []
    for raw in endpoints.split(","):
        endpoint = raw.strip()
        if not endpoint:
            continue
        if endpoint.startswith("https://"):
            raise ValueError(f"etcd endpoint {endpoint!r}: https (TLS to etcd) is not supported; use http://")
        endpoint = endpoint.removeprefix("http://").rstrip("/")
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"etcd endpoint {raw.strip()!r} is not [http://]host:port")
        parsed.append(endpoint)
    if not parsed:
        raise ValueError(f"no etcd endpoint in {endpoints!r}")
    return parsed


def prefix_end(prefix: bytes) -> bytes:
    """The range_end that makes [prefix, range_end) every key starting with `prefix`."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\x00"  # etcd: every key


@dataclass
class _Member:
    address: str
    channel: grpc.aio.Channel
    kv: rpc_pb2_grpc.KVStub
    lease: rpc_pb2_grpc.LeaseStub
    watch: rpc_pb2_grpc.WatchStub


class EtcdClient:
    """Range/Txn/lease/watch on one etcd cluster. Create inside the event loop that uses it."""

    def __init__(self, endpoints: Sequence[str], *, timeout_s: float = 5.0) -> None:
        if not endpoints:
            raise ValueError("EtcdClient needs at least one endpoint")
        self.timeout_s = timeout_s
        self._members = []
        for address in endpoints:
            channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
            self._members.append(_Member(address, channel, rpc_pb2_grpc.KVStub(channel),
                                         rpc_pb2_grpc.LeaseStub(channel), rpc_pb2_grpc.WatchStub(channel)))
        self._current = 0

    @property
    def address(self) -> str:
        """The member calls go to now."""
        return self._members[self._current].address

    async def _call(self, service: str, method: str, request, *, wait_for_ready: bool = False):
        last_error: grpc.aio.AioRpcError | None = None
        for step in range(len(self._members)):
            index = (self._current + step) % len(self._members)
            stub = getattr(self._members[index], service)
            try:
                response = await getattr(stub, method)(request, timeout=self.timeout_s,
                                                       wait_for_ready=wait_for_ready)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _FAILOVER_CODES:
                    raise
                last_error = exc
                continue
            if index != self._current:
                log.warning("etcd member %s unreachable; using %s", self.address,
                            self._members[index].address)
                self._current = index
            return response
        assert last_error is not None
        raise last_error

    async def range_prefix(self, prefix: bytes) -> rpc_pb2.RangeResponse:
        return await self._call("kv", "Range", rpc_pb2.RangeRequest(key=prefix, range_end=prefix_end(prefix)))

    async def get(self, key: bytes) -> rpc_pb2.KeyValue | None:
        response = await self._call("kv", "Range", rpc_pb2.RangeRequest(key=key))
        return response.kvs[0] if response.kvs else None

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> rpc_pb2.PutResponse:
        return await self._call("kv", "Put", rpc_pb2.PutRequest(key=key, value=value, lease=lease))

    async def txn(self, request: rpc_pb2.TxnRequest) -> rpc_pb2.TxnResponse:
        return await self._call("kv", "Txn", request)

    async def grant(self, ttl_s: int) -> rpc_pb2.LeaseGrantResponse:
        response = await self._call("lease", "LeaseGrant", rpc_pb2.LeaseGrantRequest(TTL=ttl_s))
        if response.error:
            raise RuntimeError(f"etcd refused a lease of {ttl_s}s: {response.error}")
        return response

    async def revoke(self, lease_id: int) -> bool:
        """Revoke a lease (its keys are deleted); False if it was already gone."""
        try:
            await self._call("lease", "LeaseRevoke", rpc_pb2.LeaseRevokeRequest(ID=lease_id))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:  # "requested lease not found"
                return False
            raise
        return True

    async def keep_alive(self, lease_id: int) -> int:
        """Renew a lease once; return its TTL now, 0 if it no longer exists."""
        last_error: grpc.aio.AioRpcError | None = None
        for step in range(len(self._members)):
            index = (self._current + step) % len(self._members)
            call = self._members[index].lease.LeaseKeepAlive(
                iter([rpc_pb2.LeaseKeepAliveRequest(ID=lease_id)]), timeout=self.timeout_s)
            try:
                async for response in call:
                    self._current = index
                    return response.TTL
                return 0
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _FAILOVER_CODES:
                    raise
                last_error = exc
            finally:
                call.cancel()
        assert last_error is not None
        raise last_error

    async def watch_prefix(self, prefix: bytes, start_revision: int) -> AsyncIterator[rpc_pb2.WatchResponse]:
        """Every WatchResponse for keys under `prefix` from `start_revision` on (DELETE events carry
        the deleted value). Ends with grpc.aio.AioRpcError when the stream breaks; the caller
        resynchronises and watches again (from the member `_call` last reached)."""
        request = rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(
            key=prefix, range_end=prefix_end(prefix), start_revision=start_revision, prev_kv=True))
        call = self._members[self._current].watch.Watch(iter([request]))
        try:
            async for response in call:
                yield response
        finally:
            call.cancel()

    def next_member(self) -> None:
        """Move to the next endpoint (after a broken watch stream)."""
        self._current = (self._current + 1) % len(self._members)

    async def close(self) -> None:
        for member in self._members:
            await member.channel.close()
