"""SamplingParams: how one request picks its tokens and when it stops, and the limits on them.

Torch-free, so every process reads the same defaults: the engine samples with these params
(engine.sampling), a worker builds them from the wire (services/worker/wire.py) and the gateway's
migration needs the default output budget to know how much of it a continuation has left.
"""

from __future__ import annotations

from dataclasses import dataclass

# Alternatives per token a request may ask for (OpenAI's limit).
MAX_TOP_LOGPROBS = 20
# The output budget of a request that sets none (common.proto SamplingParams.max_new_tokens).
DEFAULT_MAX_NEW_TOKENS = 128


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    temperature 0 means greedy. top_k -1 means off. `stop` strings end generation when they
    appear in the output text (excluded from it); `stop_token_ids` end it when sampled (the token
    is not shown as text). `ignore_eos` keeps generating past the model's end-of-sequence tokens.
    Lists passed for `stop`/`stop_token_ids` are stored as tuples, so params stay immutable.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def validate(self) -> SamplingParams:
        """Raise ValueError naming the first out-of-range field; return self when all are valid."""
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.top_logprobs}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(self.stop)}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {list(self.stop_token_ids)}")
        return self
