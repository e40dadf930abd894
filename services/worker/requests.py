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
from services.common.convert import sampling_from_proto


class BadRequest(ValueError):
    """A request the client must fix; becomes INVALID_ARGUMENT with this message."""

    code = grpc.StatusCode.INVALID_ARGUMENT


def parse_sampling(message: common_pb2.SamplingParams) -> SamplingParams:
    """Proto SamplingParams -> validated engine SamplingParams; BadRequest names what is wrong."""
    try:
        return sampling_from_proto(message).validate()
    except ValueError as exc:
        raise BadRequest(f"invalid sampling params: {exc}") from None


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
    params = parse_sampling(sampling)
    return EngineRequest(room=room or uuid.uuid4().hex, prompt_ids=prompt, params=params)
