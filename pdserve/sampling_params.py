"""SamplingParams: how one request picks its tokens and when it stops, and the limits on them.

Torch-free, so every process reads the same defaults: the engine samples with these params
(engine.sampling), a worker builds them from the wire (services/worker/wire.py) and the gateway's
migration needs the default output budget to know how much of it a continuation has left.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# Alternatives per token a request may ask for (OpenAI's limit).
MAX_TOP_LOGPROBS = 20
# OpenAI's ranges: presence/frequency penalties and logit_bias values.
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
# The kinds of structured output (common.proto StructuredOutput.kind).
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "ebnf", "choice")
# The output budget of a request that sets none (common.proto SamplingParams.max_new_tokens).
DEFAULT_MAX_NEW_TOKENS = 128


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output text (common.proto StructuredOutput).

    `kind` is one of STRUCTURED_KINDS; `spec` is the schema / regex / grammar text, or the
    choices for "choice", and empty for "json_object". The constraint applies to the tokens after
    `start_after` has been generated (e.g. "</think>"), or from the first token when empty.
    """

    kind: str
    spec: str | tuple[str, ...] = ""
    start_after: str = ""
    strict: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.spec, str):
            object.__setattr__(self, "spec", tuple(self.spec))

    def validate(self) -> StructuredOutput:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, "
                             f"got {self.kind!r}")
        if self.kind == "choice":
            if not self.spec or any(not isinstance(c, str) or c == "" for c in self.spec):
                raise ValueError("choice needs a non-empty list of non-empty strings")
        elif self.kind != "json_object" and not (isinstance(self.spec, str) and self.spec):
            raise ValueError(f"{self.kind} must be a non-empty string")
        return self

    @property
    def cache_key(self) -> tuple[str, str | tuple[str, ...], bool]:
        """What the compiled grammar depends on (start_after only delays it)."""
        return (self.kind, self.spec, self.strict)


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    temperature 0 means greedy. top_k -1 means off. `stop` strings end generation when they
    appear in the output text (excluded from it); `stop_token_ids` end it when sampled (the token
    is not shown as text). `ignore_eos` keeps generating past the model's end-of-sequence tokens.
    Lists passed for `stop`/`stop_token_ids` are stored as tuples, so params stay immutable.

    Penalties and biases change the logits before sampling: `presence_penalty` and
    `frequency_penalty` (OpenAI's, over output tokens), `repetition_penalty` (HF's, over prompt and
    output; 1.0 = off), `logit_bias` (token id -> added value; a mapping is stored as sorted
    (id, bias) pairs) and `min_tokens` (EOS and stop tokens masked until that many are out).
    `structured` constrains the output to a grammar (None = free).
    `kept_special_token_ids`: special tokens whose text the output text keeps (a tool call parser's
    markers); the output text skips every other special token.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default=())
    min_tokens: int = 0
    structured: StructuredOutput | None = None
    kept_special_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "kept_special_token_ids", tuple(self.kept_special_token_ids))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias: Mapping[int, float] | Iterable[tuple[int, float]] = self.logit_bias
        pairs = bias.items() if isinstance(bias, Mapping) else bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in pairs)))

    @property
    def penalized(self) -> bool:
        """Whether any penalty, bias or min_tokens changes this request's logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

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
        if any(not isinstance(t, int) or t < 0 for t in self.kept_special_token_ids):
            raise ValueError("kept_special_token_ids must be non-negative ints, "
                             f"got {list(self.kept_special_token_ids)}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
        if not 0 < self.repetition_penalty <= 1e4:  # also refuses NaN
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for token_id, bias in self.logit_bias:
            if token_id < 0:
                raise ValueError(f"logit_bias token ids must be non-negative, got {token_id}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                 f"got {bias} for token {token_id}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be at least 0, got {self.min_tokens}")
        # a minimum over the budget asks for the whole budget (the token limit still ends the request)
        object.__setattr__(self, "min_tokens", min(self.min_tokens, self.max_new_tokens))
        if self.structured is not None:
            self.structured.validate()
        return self

    def check_vocab(self, vocab_size: int) -> SamplingParams:
        """Raise ValueError if a logit_bias id is outside a vocabulary of `vocab_size` tokens."""
        bad = [t for t, _ in self.logit_bias if t >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids must be below the vocabulary size {vocab_size}, "
                             f"got {bad[:5]}")
        return self
