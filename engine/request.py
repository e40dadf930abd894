"""Request: one sequence's tokens, KV pages and progress, as the scheduler and engine loop see it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch


class RequestStatus(Enum):
    WAITING = "waiting"  # not admitted (new, or retracted and waiting to be recomputed)
    RUNNING = "running"  # admitted: owns pages for all its known tokens
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """A sequence in the engine.

    `token_ids` is the prompt followed by the generated tokens; the first `num_computed` of them
    have their K/V in `page_ids`. A running request with num_computed == len(token_ids) - 1 is
    decode-ready (its last token is fed next step); fewer computed means prefill chunks remain
    (a new prompt, or a retracted request recomputing prompt + generated tokens).

    `prefill_only` requests (the prefill side of PD) stop after their first sampled token and
    keep their pages under their room until released. `on_pages_filled` is their progress hook.
    """

    room: str
    token_ids: list[int]
    num_prompt: int
    params: Any  # engine.sampling.SamplingParams
    prefill_only: bool = False
    status: RequestStatus = RequestStatus.WAITING
    page_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    admit_order: int = -1
    num_retractions: int = 0
    finish_reason: str | None = None
    # Prefix cache: hashes of the full pages of token_ids known so far (content only, so they
    # survive retraction), and how many of page_ids were offered to the cache.
    page_hashes: list[int] = field(default_factory=list)
    pages_cached: int = 0
    # Engine-loop state (never read by the scheduler).
    generator: torch.Generator | None = None
    stop_token_ids: frozenset[int] = frozenset()  # sampling one ends the request ("stop"); eos included
    emit: Callable[[Any], None] | None = None  # delivers TokenOutput / PrefillResult to the caller
    on_pages_filled: Callable[[list[int], int], None] | None = None
    pages_reported: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def decode_ready(self) -> bool:
        return self.num_computed == len(self.token_ids) - 1
