"""Driving workers through their gRPC API (pdserve.v1.Worker), as the gateway does."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.channels import open_channel
from services.common.security import GrpcSecurity

_ROOMS = itertools.count()


@dataclass
class Result:
    """One Generate call: its tokens, or the status it failed with."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    code: grpc.StatusCode | None = None
    details: str = ""


def greedy(max_new_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True,
                                     logprobs=True)


async def generate(stub: worker_pb2_grpc.WorkerStub, prompt: Sequence[int], *, prefill: str | None = None,
                   max_new_tokens: int = 16, timeout_s: float = 120.0, lora: str = "",
                   sampling: common_pb2.SamplingParams | None = None) -> Result:
    """One Generate call; `sampling` replaces the greedy default of `max_new_tokens` tokens."""
    request = worker_pb2.GenerateRequest(room=f"test-{next(_ROOMS)}", prompt_token_ids=list(prompt),
                                         sampling=sampling or greedy(max_new_tokens), lora_adapter=lora)
    if prefill is not None:
        request.prefill_address = prefill
    result = Result()
    try:
        async for response in stub.Generate(request, timeout=timeout_s):
            for output in response.outputs:
                result.tokens.append(output.token_id)
                result.logprobs.append(output.logprob)
            result.tokens.extend(response.token_ids)  # the form of tokens without logprobs
            if response.finish_reason:
                result.finish_reason = response.finish_reason
    except grpc.aio.AioRpcError as exc:
        result.code, result.details = exc.code(), exc.details()
    return result


async def generate_all(address: str, prompts: Sequence[Sequence[int]],
                       prefills: Sequence[str | None] | None = None,
                       *, security: GrpcSecurity | None = None, **kwargs) -> list[Result]:
    """Every prompt at once on one channel (so the worker batches them)."""
    prefills = prefills or [None] * len(prompts)
    async with open_channel(address, security or GrpcSecurity()) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        return list(await asyncio.gather(*(generate(stub, p, prefill=f, **kwargs)
                                           for p, f in zip(prompts, prefills, strict=True))))


def run_all(address: str, prompts, prefills=None, **kwargs) -> list[Result]:
    return asyncio.run(generate_all(address, prompts, prefills, **kwargs))
