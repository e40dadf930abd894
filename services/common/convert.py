"""Protobuf <-> engine and libkv dataclass conversion, in one place (libkv and engine never import protos).

KV layout, transfer endpoint, sampling params, finish reasons, token outputs. Imports libkv and
engine (and so torch): used by the prefill, decode and colocated workers, never by the
gateway or the registry.
"""

from __future__ import annotations

from engine.sampling import SamplingParams
from libkv.layout import KVLayout
from libkv.transfer import TransferEndpoint
from protos.v1 import common_pb2


def layout_to_proto(layout: KVLayout) -> common_pb2.KVLayout:
    return common_pb2.KVLayout(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                               head_dim=layout.head_dim, page_size=layout.page_size, dtype=layout.dtype)


def layout_from_proto(message: common_pb2.KVLayout) -> KVLayout:
    """Raises ValueError (from KVLayout's own checks) for a missing or invalid layout."""
    return KVLayout(num_layers=message.num_layers, num_kv_heads=message.num_kv_heads,
                    head_dim=message.head_dim, page_size=message.page_size, dtype=message.dtype)


_FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}


def finish_reason_to_proto(reason: str | None) -> common_pb2.FinishReason:
    """The engine's "stop" | "length" | "abort" | None (not finished) as the proto enum."""
    if reason is None:
        return common_pb2.FINISH_REASON_UNSPECIFIED
    try:
        return _FINISH_REASONS[reason]
    except KeyError:
        raise ValueError(f"unknown finish reason {reason!r}; expected one of {sorted(_FINISH_REASONS)}") from None


def finish_reason_from_proto(reason: common_pb2.FinishReason) -> str | None:
    for name, value in _FINISH_REASONS.items():
        if value == reason:
            return name
    return None


def token_to_proto(token_id: int, text: str, logprob: float | None,
                   top_logprobs: list[tuple[int, float]]) -> common_pb2.TokenOutput:
    """One sampled token (engine.outputs.TokenOutput / FirstToken fields) as a proto TokenOutput;
    an unrequested logprob (None) is sent as 0 (the caller asked for none, so reads none)."""
    return common_pb2.TokenOutput(
        token_id=token_id, text=text, logprob=logprob if logprob is not None else 0.0,
        top_logprobs=[common_pb2.TokenLogprob(token_id=tid, logprob=lp) for tid, lp in top_logprobs])


def endpoint_to_proto(endpoint: TransferEndpoint) -> common_pb2.TransferEndpoint:
    return common_pb2.TransferEndpoint(backend=endpoint.backend, host=endpoint.host,
                                       layout=layout_to_proto(endpoint.layout), descriptor=endpoint.blob,
                                       num_pages=endpoint.num_pages)


def endpoint_from_proto(message: common_pb2.TransferEndpoint) -> TransferEndpoint:
    """Raises ValueError if the endpoint or its layout is missing."""
    if not message.backend:
        raise ValueError("transfer endpoint has no backend")
    return TransferEndpoint(backend=message.backend, layout=layout_from_proto(message.layout),
                            host=message.host, num_pages=message.num_pages, blob=message.descriptor)


def sampling_from_proto(message: common_pb2.SamplingParams) -> SamplingParams:
    """Fields left unset in the message take engine.sampling.SamplingParams' defaults (so a default
    lives in one place). top_k 0 (proto3's unset) means off, as -1 does. Not validated: callers
    call `.validate()` and answer INVALID_ARGUMENT with its message."""
    values: dict = {
        "top_k": message.top_k if message.top_k != 0 else -1,  # other negatives fail validate()
        "min_p": message.min_p,
        "stop": tuple(message.stop),
        "stop_token_ids": tuple(message.stop_token_ids),
        "ignore_eos": message.ignore_eos,
        "logprobs": message.logprobs,
        "top_logprobs": message.top_logprobs,
    }
    for name in ("temperature", "top_p", "seed", "max_new_tokens"):
        if message.HasField(name):
            values[name] = getattr(message, name)
    return SamplingParams(**values)


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    message = common_pb2.SamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
        max_new_tokens=params.max_new_tokens, stop=list(params.stop), stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos, logprobs=params.logprobs, top_logprobs=params.top_logprobs)
    if params.seed is not None:
        message.seed = params.seed
    return message
