"""random: a uniformly random candidate."""

from __future__ import annotations

import random
from collections.abc import Sequence

from services.gateway.policies.base import Policy
from services.gateway.workers import WorkerHandle


class RandomPolicy(Policy):
    """Uniform choice; `seed` makes the sequence reproducible (tests)."""

    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._random = random.Random(seed)

    def choose(self, candidates: Sequence[WorkerHandle], prompt_token_ids: Sequence[int],
               lora: str | None = None) -> WorkerHandle:
        return self._random.choice(list(candidates))
