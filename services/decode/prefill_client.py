"""Decode's client of the Prefill service: one channel per prefill worker, errors as PrefillFailed."""

from __future__ import annotations

import logging

import grpc

from engine.outputs import FirstToken
from engine.sampling import SamplingParams
from protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.convert import sampling_to_proto

log = logging.getLogger("pdserve.decode")

# Codes whose message the client must see as-is: retrying elsewhere would fail the same way.
_PASS_THROUGH = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                 grpc.StatusCode.RESOURCE_EXHAUSTED)

# Keepalive pings find a prefill host that vanished without closing its connections.
_CHANNEL_OPTIONS = [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
                    ("grpc.keepalive_permit_without_calls", 1)]


class PrefillFailed(RuntimeError):
    """The Prefill call did not return a first token. `code` is what decode reports to its caller:
    UNAVAILABLE (retryable on another pair) unless the prefill said the request itself is wrong."""

    def __init__(self, message: str, code: grpc.StatusCode, stage: str) -> None:
        super().__init__(message)
        self.code = code
        self.stage = stage


class PrefillClients:
    """Cached channels to prefill workers, keyed by their gRPC address."""

    def __init__(self, abort_timeout_s: float) -> None:
        self.abort_timeout_s = abort_timeout_s
        self._stubs: dict[str, worker_pb2_grpc.PrefillStub] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> worker_pb2_grpc.PrefillStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
            self._channels[address] = channel
            stub = self._stubs[address] = worker_pb2_grpc.PrefillStub(channel)
        return stub

    async def prefill(self, address: str, *, room: str, prompt: list[int], params: SamplingParams,
                      dst_page_ids: list[int], dst: common_pb2.TransferEndpoint, decode_worker_id: str,
                      model: str, timeout_s: float) -> FirstToken:
        request = worker_pb2.PrefillRequest(
            room=room, prompt_token_ids=prompt, sampling=sampling_to_proto(params),
            dst_page_ids=dst_page_ids, dst=dst, decode_worker_id=decode_worker_id, model=model)
        try:
            response = await self._stub(address).Prefill(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            stage = "bootstrap" if code == grpc.StatusCode.FAILED_PRECONDITION else "prefill"
            if code in _PASS_THROUGH:
                raise PrefillFailed(f"prefill {address}: {exc.details()}", code, stage) from None
            raise PrefillFailed(f"prefill {address} failed ({code.name}): {exc.details()}",
                                grpc.StatusCode.UNAVAILABLE, stage) from None
        first = response.first_token
        return FirstToken(token_id=first.token_id, logprob=first.logprob if params.logprobs else None,
                          top_logprobs=[(t.token_id, t.logprob) for t in first.top_logprobs])

    async def abort(self, address: str, room: str) -> bool:
        """Ask prefill to stop `room`. True once it guarantees no more writes for it (or is gone, and
        so cannot write); False if it did not answer in time."""
        try:
            await self._stub(address).Abort(worker_pb2.AbortRequest(room=room), timeout=self.abort_timeout_s)
            return True
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                return True  # the process is gone: nothing of it can write any more
            log.error("room %s: prefill %s did not confirm the abort (%s: %s); its pages stay "
                      "quarantined for one transfer timeout", room, address, exc.code().name, exc.details())
            return False

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
