"""power_of_two: sample two candidates, send to the less loaded one.

Load is this gateway's in-flight count on the worker, then the queue the worker reported to the
registry (WorkerHandle.load). Two random probes avoid both round robin's blindness to load and
the herd effect of always picking the global minimum when load information is stale.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from services.gateway.policies.base import Policy
from services.gateway.workers import WorkerHandle


class PowerOfTwoPolicy(Policy):
    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        self._random = random.Random(seed)

    def choose(self, candidates: Sequence[WorkerHandle], prompt_token_ids: Sequence[int],
               lora: str | None = None) -> WorkerHandle:
        if len(candidates) == 1:
            return candidates[0]
        first, second = self._random.sample(list(candidates), 2)
        return second if second.load < first.load else first
