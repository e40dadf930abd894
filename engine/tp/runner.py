"""Keeping the ranks in step: rank 0 sends each step's plan, followers run the same forward pass.

Rank 0's scheduler alone decides what runs (pages, chunks, retractions); the SchedulerOutput it
hands its model runner is the whole plan of a step, so broadcasting it is all a follower needs to
run the same step on its shard: same page ids (every rank's pool is indexed the same), same
tokens, and the same all-reduces in the same order. Followers compute the (replicated) logits and
drop them; only rank 0 samples.
"""

from __future__ import annotations

import logging

import torch

from engine.model_runner import ModelRunner
from engine.scheduler import SchedulerOutput
from engine.tp.group import TPGroup

log = logging.getLogger(__name__)


class DriverRunner:
    """Rank 0's model runner: broadcasts the step, then runs its own shard (the engine thread calls it)."""

    def __init__(self, runner: ModelRunner, group: TPGroup) -> None:
        self.runner = runner
        self.group = group

    def forward(self, batch: SchedulerOutput) -> torch.Tensor:
        """The step's logits (rank 0 always gets them: from the last pipeline stage, or under DP
        attention every group's; a DPStep takes the place of `batch` then)."""
        self.group.broadcast(batch)
        logits = self.runner.step(batch)
        if logits is None:
            raise RuntimeError("rank 0's step returned no logits")
        return logits

    def close(self) -> None:
        """Tell the followers to leave their loop (after the engine thread has stopped) and leave the
        group, so this process can form another one later. Raises RuntimeError if the group is broken."""
        try:
            self.group.broadcast(None)
        finally:
            self.group.close()


def follow(group: TPGroup, runner: ModelRunner) -> None:
    """A follower's loop: run every step rank 0 broadcasts until it sends None."""
    steps = 0
    with torch.inference_mode():
        while True:
            batch = group.broadcast(None)
            if batch is None:
                log.info("rank 0 closed the group after %d steps", steps)
                return
            # unpickled, so typed object: a SchedulerOutput, or under DP attention a DPStep (whose
            # runner is a DPRankRunner: engine.tp.load)
            runner.step(batch)  # type: ignore[arg-type]
            steps += 1
