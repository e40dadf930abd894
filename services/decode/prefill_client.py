"""Decode's client of the Prefill service: one channel per prefill worker, errors as PrefillFailed."""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import grpc

from engine.outputs import FirstToken
from engine.sampling import SamplingParams
from protos.v1 import worker_pb2, worker_pb2_grpc
from services.common.bytes_field_wire import append_bytes_field
from services.common.channels import open_channel
from services.common.security import GrpcSecurity
from services.worker.metrics import HANDSHAKE

log = logging.getLogger("pdserve.decode")

# Codes whose message the client must see as-is: retrying elsewhere would fail the same way.
_PASS_THROUGH = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                 grpc.StatusCode.RESOURCE_EXHAUSTED)
_CONNECT_PROBE_S = 2.0
# A channel given up on still carries the calls already on it (to a live process that only failed one
# call); it is closed once they finish, or after this long.
_RETIRED_GRACE_S = 600.0
# gRPC shares connections (subchannels) between the channels of a process by default, so a new channel
# would inherit the old one's reconnect backoff; each channel here owns its connections.
_OWN_SUBCHANNELS = (("grpc.use_local_subchannel_pool", 1),)
_PREFILL = "/pdserve.v1.Prefill/Prefill"


def _as_is(wire: bytes) -> bytes:
    return wire


class PrefillFailed(RuntimeError):
    """The Prefill call did not return a first token. `code` is what decode reports to its caller:
    UNAVAILABLE (retryable on another pair) unless the prefill said the request itself is wrong."""

    def __init__(self, message: str, code: grpc.StatusCode, stage: str) -> None:
        super().__init__(message)
        self.code = code
        self.stage = stage


@dataclass(frozen=True)
class PrefillReply:
    """What a successful Prefill call returns: the first token, and the checksum of every page
    as written (in dst_page_ids order) when decode asked for them."""

    first: FirstToken
    page_checksums: list[int]
    tp_size: int = 1  # the prefill's: how its checksums split the KV heads (libkv.landing)


class AbortOutcome(enum.Enum):
    """What decode learned from asking a prefill to stop a room."""

    CONFIRMED = "confirmed"  # the prefill answered: it issues no more writes for the room
    GONE = "gone"            # nothing listens at its address any more: its process is gone
    UNKNOWN = "unknown"      # no answer (frozen, partitioned, overloaded): writes may still come


@dataclass
class AbortReply:
    """The outcome, and (CONFIRMED only) the checksums of the writes the prefill issued for the
    room, in dst_page_ids order: the first len(page_checksums) pages may still be landing."""

    outcome: AbortOutcome
    page_checksums: list[int] = field(default_factory=list)
    tp_size: int = 1  # the prefill's (see PrefillReply)


class PrefillClients:
    """Cached channels to prefill workers, keyed by their gRPC address.

    An address is not an identity: a prefill restarted on the same host and port is a new process. A
    channel that saw a call fail UNAVAILABLE (connection refused or reset: the process may be gone)
    is dropped, and so is the channel of an address where the registry reports a new worker
    (`forget`): the next call opens a fresh one. Reused, the old channel would sit in gRPC's
    reconnect backoff after the refused connections of the downtime and fail the new process's first
    calls at once ("failed to connect to all addresses") though it listens."""

    def __init__(self, abort_timeout_s: float, security: GrpcSecurity | None = None) -> None:
        self.abort_timeout_s = abort_timeout_s
        self.security = security or GrpcSecurity()
        self._stubs: dict[str, worker_pb2_grpc.PrefillStub] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._retiring: dict[asyncio.Task, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> tuple[worker_pb2_grpc.PrefillStub, grpc.aio.Channel]:
        stub = self._stubs.get(address)
        if stub is None:
            channel = open_channel(address, self.security, options=_OWN_SUBCHANNELS)
            self._channels[address] = channel
            stub = self._stubs[address] = worker_pb2_grpc.PrefillStub(channel)
        return stub, self._channels[address]

    def forget(self, address: str, channel: grpc.aio.Channel | None = None) -> None:
        """Open a new channel for the next call to `address` (only if its channel is still `channel`,
        when given: another call may have replaced it already). Calls on the old one run to their end."""
        current = self._channels.get(address)
        if current is None or (channel is not None and current is not channel):
            return
        del self._channels[address], self._stubs[address]
        task = asyncio.get_running_loop().create_task(current.close(grace=_RETIRED_GRACE_S))
        self._retiring[task] = current
        task.add_done_callback(lambda done: self._retiring.pop(done, None))

    async def prefill(self, address: str, request: worker_pb2.PrefillRequest, params: SamplingParams,
                      timeout_s: float, images: Sequence[bytes | memoryview] = ()) -> PrefillReply:
        """Prefill.Prefill(`request` with `images` as its images field: written into the wire bytes
        in a thread, services/common/bytes_field_wire.py, so the images are copied once and never by
        protobuf on the loop)."""
        stub, channel = self._stub(address)
        try:
            if images:
                wire = await asyncio.to_thread(append_bytes_field, request.SerializeToString(),
                                               worker_pb2.PrefillRequest.IMAGES_FIELD_NUMBER, images)
                call = channel.unary_unary(_PREFILL, request_serializer=_as_is,
                                           response_deserializer=worker_pb2.PrefillResponse.FromString)
                response = await call(wire, timeout=timeout_s)
            else:
                response = await stub.Prefill(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.UNAVAILABLE:
                self.forget(address, channel)
            stage = HANDSHAKE if code == grpc.StatusCode.FAILED_PRECONDITION else "prefill"
            if code in _PASS_THROUGH:
                raise PrefillFailed(f"prefill {address}: {exc.details()}", code, stage) from None
            if code == grpc.StatusCode.UNIMPLEMENTED:
                raise PrefillFailed(f"prefill_address {address} does not serve pdserve.v1.Prefill",
                                    grpc.StatusCode.INVALID_ARGUMENT, stage) from None
            raise PrefillFailed(f"prefill {address} failed ({code.name}): {exc.details()}",
                                grpc.StatusCode.UNAVAILABLE, stage) from None
        first = response.first_token
        return PrefillReply(
            FirstToken(token_id=first.token_id, logprob=first.logprob if params.logprobs else None,
                       top_logprobs=[(t.token_id, t.logprob) for t in first.top_logprobs]),
            list(response.page_checksums), response.tp_size or 1)

    async def abort(self, address: str, room: str) -> AbortReply:
        """Ask prefill to stop `room`; says whether it can still issue writes for it.

        An answer (even UNIMPLEMENTED: no Prefill service there, so nothing writes for the room)
        confirms. No answer is proof of nothing: a frozen process keeps its listening socket, and
        a partition heals, so an UNAVAILABLE call is followed by a plain TCP connect: only a
        refused connection means the process is gone."""
        stub, channel = self._stub(address)
        try:
            reply = await stub.Abort(worker_pb2.AbortRequest(room=room), timeout=self.abort_timeout_s)
            return AbortReply(AbortOutcome.CONFIRMED, list(reply.page_checksums), reply.tp_size or 1)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.UNAVAILABLE:
                self.forget(address, channel)  # the retry must not wait out the old channel's backoff
            if code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAUTHENTICATED):
                return AbortReply(AbortOutcome.CONFIRMED)  # not our prefill: it never wrote for this room
            if code == grpc.StatusCode.UNAVAILABLE and await _connection_refused(address):
                return AbortReply(AbortOutcome.GONE)
            log.debug("room %s: prefill %s did not confirm the abort (%s: %s)", room, address,
                      code.name, exc.details())
            return AbortReply(AbortOutcome.UNKNOWN)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        retiring = dict(self._retiring)
        for task in retiring:
            task.cancel()  # stop waiting for their calls: shutting down ends them
        await asyncio.gather(*retiring, return_exceptions=True)
        for channel in retiring.values():
            await channel.close()


async def _connection_refused(address: str) -> bool:
    try:
        parts = urlsplit(f"grpc://{address}")
        host, port = parts.hostname, parts.port
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), _CONNECT_PROBE_S)
    except ConnectionRefusedError:
        return True
    except (OSError, TimeoutError, ValueError):
        return False  # unreachable or slow: it may still be alive
    writer.close()
    return False
