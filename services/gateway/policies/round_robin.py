"""round_robin: candidates in turn, whatever their load."""

from __future__ import annotations

from collections.abc import Sequence

from services.gateway.policies.base import Policy
from services.gateway.workers import WorkerHandle


class RoundRobinPolicy(Policy):
    """The i-th request goes to candidates[i mod len(candidates)]. Candidates come sorted by
    address, so a fixed set of workers is visited in a fixed cycle."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates: Sequence[WorkerHandle], prompt_token_ids: Sequence[int],
               lora: str | None = None) -> WorkerHandle:
        chosen = candidates[self._next % len(candidates)]
        self._next += 1
        return chosen
