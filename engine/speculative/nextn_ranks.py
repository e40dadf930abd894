"""NEXTN on a tensor-parallel engine: every rank runs each MTP layer forward on its shard.

Rank 0 alone drafts (engine.speculative.nextn decides which requests draft and how many tokens, from
rank 0's scheduler and budgets). Each forward of its MTP layer (catch-up, draft step, prefill's
prompt K/V) goes to the followers first, through the step-plan broadcast the target's steps use
(engine.tp.runner), as an MTPStep: the batch and the target hidden states it reads, rank 0's, so
every rank feeds its shard the same rows. A follower's runner tells the two kinds of step apart.
The collectives stay in one order on every rank: rank 0's engine thread issues all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.models.config import ModelConfig
from engine.models.decoder import DecoderModel
from engine.models.mtp import MTPLayer
from engine.scheduler import SchedulerOutput
from engine.tp.group import TPGroup
from engine.tp.shard import TPShard
from libkv.pool import KVPool


def check_nextn_topology(config: EngineConfig) -> None:
    """ValueError naming why for a rank layout NEXTN cannot run on."""
    if config.pp_size > 1:
        raise ValueError("--speculative-algorithm NEXTN with --pp-size > 1 is not supported: the MTP layer "
                         "reads the last stage's hidden states and the first stage's embedding, and its "
                         "drafts would have to travel back to rank 0, which schedules")


@dataclass(frozen=True)
class MTPStep:
    """One forward of the MTP layer: `batch` as ModelRunner takes it, `hidden_in` its rows' target
    hidden states (on the CPU, so it pickles the same from any device)."""

    batch: SchedulerOutput
    hidden_in: torch.Tensor


class MTPDriverRunner:
    """Rank 0's runner of the MTP layer: sends each step to the followers, then runs its own shard."""

    def __init__(self, runner: ModelRunner, mtp: MTPLayer, group: TPGroup) -> None:
        self.runner = runner
        self.mtp = mtp
        self.group = group

    def step(self, batch: SchedulerOutput) -> torch.Tensor | None:
        if self.mtp.hidden_in is None:
            raise RuntimeError("an MTP step needs hidden_in set")
        self.group.broadcast(MTPStep(batch, self.mtp.hidden_in.cpu()))
        return self.runner.step(batch)

    def forward(self, batch: SchedulerOutput) -> torch.Tensor:
        logits = self.step(batch)
        if logits is None:
            raise RuntimeError("rank 0's MTP step returned no logits")
        return logits


class NextNFollowerRunner:
    """A follower's runner with NEXTN: the target's steps to the target's runner, MTPSteps to the MTP
    layer's (engine.tp.runner.follow calls `step` with whatever rank 0 broadcast)."""

    def __init__(self, target_runner: ModelRunner, mtp_runner: ModelRunner, mtp: MTPLayer) -> None:
        self.target_runner = target_runner
        self.mtp_runner = mtp_runner
        self.mtp = mtp

    def step(self, batch: SchedulerOutput | MTPStep) -> torch.Tensor | None:
        if isinstance(batch, MTPStep):
            self.mtp.hidden_in = batch.hidden_in.to(self.mtp_runner.device)
            return self.mtp_runner.step(batch.batch)
        return self.target_runner.step(batch)


def follower_runner(config: EngineConfig, model_config: ModelConfig, model: DecoderModel, pool: KVPool,
                    runner: ModelRunner, shard: TPShard) -> ModelRunner | NextNFollowerRunner:
    """A follower rank's runner: `runner` itself unless the engine drafts with NEXTN."""
    if config.speculative.speculative_algorithm != "NEXTN":
        return runner
    mtp = MTPLayer.load(config.model_path, model_config, model, shard)
    return NextNFollowerRunner(runner, ModelRunner(mtp, pool), mtp)  # type: ignore[arg-type]
