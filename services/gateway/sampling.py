"""The sampling settings of one generation, between the HTTP layer and the Worker.Generate call.

`None` means "not given": the field stays unset in the proto so the worker's default applies
(temperature 1.0, top_p 1.0, max_new_tokens 128), as the proto's `optional` fields intend.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from protos.v1 import common_pb2

_FLOAT32_TINY = 1.401298464324817e-45  # the smallest positive float32


def _wrap_int64(value: int) -> int:
    """`value` wrapped into the proto's int64 range (a seed near 2**63 - 1 plus a choice index)."""
    return (value + 2**63) % 2**64 - 2**63


@dataclass(frozen=True)
class Sampling:
    """What one choice is sampled with; `for_choice(i)` gives choice i of an n > 1 request."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_new_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0

    def for_choice(self, index: int) -> Sampling:
        # n choices with one seed would be n identical samples; seed + i keeps them reproducible
        # and distinct (greedy choices are identical regardless).
        if self.seed is None or index == 0:
            return self
        return replace(self, seed=_wrap_int64(self.seed + index))

    def to_proto(self) -> common_pb2.SamplingParams:
        params = common_pb2.SamplingParams(
            top_k=max(self.top_k, 0), min_p=self.min_p, stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos,
            logprobs=self.logprobs or self.top_logprobs > 0, top_logprobs=self.top_logprobs)
        if self.temperature is not None:
            params.temperature = self.temperature
        if self.top_p is not None:
            # the proto field is float32: a top_p below its smallest positive value would arrive as
            # 0 (refused by the worker); keeping only the most likely token is what it asks for
            params.top_p = max(self.top_p, _FLOAT32_TINY)
        if self.seed is not None:
            params.seed = self.seed
        if self.max_new_tokens is not None:
            params.max_new_tokens = self.max_new_tokens
        return params


def sampling_from_fields(*, temperature: float | None, top_p: float | None, top_k: int | None,
                         min_p: float | None, seed: int | None, max_new_tokens: int | None,
                         stop: list[str], stop_token_ids: list[int] | None, ignore_eos: bool,
                         logprobs: bool = False, top_logprobs: int = 0) -> Sampling:
    """A Sampling from request fields as the HTTP bodies name them (None = not given)."""
    return Sampling(temperature=temperature, top_p=top_p, top_k=max(top_k or 0, 0), min_p=min_p or 0.0,
                    seed=seed, max_new_tokens=max_new_tokens, stop=tuple(stop),
                    stop_token_ids=tuple(stop_token_ids or ()), ignore_eos=ignore_eos, logprobs=logprobs,
                    top_logprobs=top_logprobs)
