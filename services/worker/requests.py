"""Turning a Generate/Prefill request into engine inputs, with gRPC errors for bad input.

Every check a client can fail is here, so the servicers abort with INVALID_ARGUMENT and a message
instead of letting a bad request reach the engine thread.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import grpc

from engine.sampling import SamplingParams
from protos.v1 import common_pb2


class BadRequest(ValueError):
    """A request the client must fix; becomes INVALID_ARGUMENT with this message."""

    code = grpc.StatusCode.INVALID_ARGUMENT


def sampling_from_proto(message: common_pb2.SamplingParams) -> SamplingParams:
    """Proto SamplingParams -> engine SamplingParams (unset optionals keep the engine defaults)."""
    defaults = SamplingParams()
    params = SamplingParams(
        temperature=message.temperature if message.HasField("temperature") else defaults.temperature,
        top_p=message.top_p if message.HasField("top_p") else defaults.top_p,
        top_k=message.top_k if message.top_k not in (0,) else defaults.top_k,
        min_p=message.min_p,
        seed=message.seed if message.HasField("seed") else None,
        max_new_tokens=message.max_new_tokens if message.HasField("max_new_tokens") else defaults.max_new_tokens,
        stop=tuple(message.stop), stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=message.ignore_eos, logprobs=message.logprobs, top_logprobs=message.top_logprobs)
    try:
        params.validate()
    except ValueError as exc:
        raise BadRequest(f"invalid sampling params: {exc}") from None
    return params


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    message = common_pb2.SamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
        max_new_tokens=params.max_new_tokens, stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
        logprobs=params.logprobs, top_logprobs=params.top_logprobs)
    if params.seed is not None:
        message.seed = params.seed
    return message


@dataclass(frozen=True)
class EngineRequest:
    room: str
    prompt_ids: list[int]
    params: SamplingParams


def parse_request(room: str, prompt_token_ids, sampling: common_pb2.SamplingParams, *,
                  vocab_size: int, context_len: int) -> EngineRequest:
    """Validate ids and lengths; a missing room gets a fresh id."""
    prompt = list(prompt_token_ids)
    if not prompt:
        raise BadRequest("prompt_token_ids is empty: a prompt needs at least one token")
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise BadRequest(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(prompt) >= context_len:
        raise BadRequest(f"prompt of {len(prompt)} tokens does not fit the model's context of "
                         f"{context_len} tokens")
    params = sampling_from_proto(sampling)
    return EngineRequest(room=room or uuid.uuid4().hex, prompt_ids=prompt, params=params)
