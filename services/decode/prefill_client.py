"""Decode's client of the Prefill service: one channel per prefill worker, errors as PrefillFailed."""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import grpc

from engine.outputs import FirstToken
from engine.sampling import SamplingParams
from protos.v1 import worker_pb2, worker_pb2_grpc
from services.common.channels import open_channel
from services.common.security import GrpcSecurity
from services.worker.metrics import HANDSHAKE

log = logging.getLogger("pdserve.decode")

# Codes whose message the client must see as-is: retrying elsewhere would fail the same way.
_PASS_THROUGH = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                 grpc.StatusCode.RESOURCE_EXHAUSTED)
_CONNECT_PROBE_S = 2.0


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
    """Cached channels to prefill workers, keyed by their gRPC address."""

    def __init__(self, abort_timeout_s: float, security: GrpcSecurity | None = None) -> None:
        self.abort_timeout_s = abort_timeout_s
        self.security = security or GrpcSecurity()
        self._stubs: dict[str, worker_pb2_grpc.PrefillStub] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> worker_pb2_grpc.PrefillStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = open_channel(address, self.security)
            self._channels[address] = channel
            stub = self._stubs[address] = worker_pb2_grpc.PrefillStub(channel)
        return stub

    async def prefill(self, address: str, request: worker_pb2.PrefillRequest, params: SamplingParams,
                      timeout_s: float) -> PrefillReply:
        try:
            response = await self._stub(address).Prefill(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
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
        try:
            reply = await self._stub(address).Abort(worker_pb2.AbortRequest(room=room), timeout=self.abort_timeout_s)
            return AbortReply(AbortOutcome.CONFIRMED, list(reply.page_checksums), reply.tp_size or 1)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
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
