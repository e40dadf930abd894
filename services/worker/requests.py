"""Turning a Generate/Prefill request into engine inputs, with gRPC errors for bad input.

Every check a client can fail is here, so the servicers abort with INVALID_ARGUMENT and a message
instead of letting a bad request reach the engine thread.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import grpc

from engine.engine import Engine
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


def parse_request(engine: Engine, room: str, prompt_token_ids, sampling: common_pb2.SamplingParams, *,
                  prompt_only: bool = False) -> EngineRequest:
    """Validate ids, lengths and sampling against `engine`'s model and KV pool; a missing room
    gets a fresh id. `prompt_only` (prefill) checks that the prompt fits, not the whole request."""
    model = engine.model_config
    prompt = list(prompt_token_ids)
    if not prompt:
        raise BadRequest("prompt_token_ids is empty: a prompt needs at least one token")
    bad = next((t for t in prompt if not 0 <= t < model.vocab_size), None)
    if bad is not None:
        raise BadRequest(f"prompt token id {bad} is outside the vocabulary [0, {model.vocab_size})")
    if len(prompt) >= model.max_position_embeddings:
        raise BadRequest(f"prompt of {len(prompt)} tokens does not fit the model's context of "
                         f"{model.max_position_embeddings} tokens")
    params = parse_sampling(sampling)
    try:
        engine.scheduler.check_fits(len(prompt), 1 if prompt_only else params.max_new_tokens)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    return EngineRequest(room=room or uuid.uuid4().hex, prompt_ids=prompt, params=params)
