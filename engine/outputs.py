"""What the engine hands back to its callers: token outputs, stats."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenOutput:
    """One generated token of a request as it streams out.

    `text` is the newly completed text (may be empty while a UTF-8 character or a possible stop
    string is held back). `logprob`/`top_logprobs` are filled when the request asked for them.
    The last output of a request has `finish_reason` set ("stop", "length" or "abort"); an abort
    output carries token_id -1 and no text. A prefill-only request's one output is its first
    token, with no text and finish_reason "stop" (engine.request).
    """

    token_id: int
    text: str
    logprob: float | None
    top_logprobs: list[tuple[int, float]]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class FirstToken:
    """The token sampled at the end of a prefill, with its logprob data (the PD aux data): what a
    prefilled EngineRequest starts from."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics and log lines."""

    waiting: int  # requests queued for admission, retracted ones included
    running: int
    retracted: int  # of the waiting ones, how many were retracted
    total_retractions: int
    used_pages: int
    total_pages: int
    held_rooms: int  # PD reservations and finished prefills not yet released
    reserved_pages: int  # pages of those reservations and holds
    running_tokens: int  # tokens (prompt + generated) of the running requests
    generated_tokens: int
    steps: int
    # Prefix cache (zero when it is off): pages indexed now, and running totals.
    cached_pages: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_evicted_pages: int = 0
    # Structured outputs (engine.grammar): running totals.
    grammar_compiles: int = 0
    grammar_compile_seconds: float = 0.0
    grammar_cache_hits: int = 0
    grammar_refused: int = 0
    constrained_steps: int = 0  # request-steps sampled under a grammar mask


class RequestAborted(Exception):
    """A prefill-only request was aborted before its first token (its stream ended in "abort")."""
