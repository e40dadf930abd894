"""Protobuf <-> engine/libkv dataclass conversion, in one place (libkv and engine never import protos).

Imports libkv (and so torch): used by the prefill, decode and colocated workers, never by the
gateway or the registry.
"""

from __future__ import annotations

from libkv.layout import KVLayout
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
