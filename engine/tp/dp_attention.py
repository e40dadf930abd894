"""DP attention on one rank: attention over its DP group's own tokens, the MLP over every group's.

With `--enable-dp-attention --dp-size D` the tp_size ranks of a stage form D attention groups of
attn_tp_size = tp_size / D ranks (engine.tp.topology). Each group runs its own batch (its own
requests, scheduler, KV pool and prefix cache: engine.dp_engine) through attention, split over
its attn_tp_size ranks like plain TP. The MLP (dense or routed) is split over all tp_size ranks
as without DP, so every layer:

    x (this group's T_g rows) --all-gather over the TP group--> every group's rows [sum T, hidden]
    MLP partial on those rows --all-reduce over the TP group--> the whole MLP output
    keep this group's T_g rows

A group with nothing to run still joins every gather and all-reduce with zero rows (the others'
MLP needs its column slice). Row counts per group come from the step plan, which every rank has,
so the gather needs no size exchange: each rank pads its rows to the largest group's.

At the end the final-normed rows to sample are gathered the same way and rank 0 computes every
group's logits (the LM head is replicated), so rank 0 samples for all groups as it does for one.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner


@dataclass
class StepShape:
    """Rows per DP group in this step: tokens through the layers, and rows sampled at the end."""

    tokens: list[int]
    sampled: list[int]


class DPAttentionComm:
    """One rank's collectives for DP attention (see the module doc). `attn_group` sums attention's
    row-parallel outputs within this rank's DP group (None: the group is one rank, nothing to sum);
    `tp_group` is the stage's TP group the MLP spans (None: the whole world)."""

    def __init__(self, rank: int, topology, tp_group, attn_group, device: torch.device,
                 traffic: Counter | None = None) -> None:
        self.dp_size = topology.dp_size
        self.attn_tp_size = topology.attn_tp_size
        self.dp_rank = topology.attn_dp_rank(rank)
        self.tp_group, self.attn_group = tp_group, attn_group
        self.is_driver = rank == 0
        self.device = device
        self.shape = StepShape([0] * self.dp_size, [0] * self.dp_size)
        self.traffic = traffic if traffic is not None else Counter()  # the rank group's byte counts

    def set_step(self, shape: StepShape) -> None:
        self.shape = shape

    def attn_all_reduce(self, tensor: torch.Tensor) -> None:
        if self.attn_group is None:
            return
        self.traffic["all_reduce"] += tensor.numel() * 4
        wide = tensor if tensor.dtype == torch.float32 else tensor.float()
        dist.all_reduce(wide, group=self.attn_group)
        if wide is not tensor:
            tensor.copy_(wide)

    def gather(self, rows: torch.Tensor, counts: list[int] | None = None) -> torch.Tensor:
        """Every group's rows [sum(counts), width], in group order, from this group's `rows`."""
        counts = self.shape.tokens if counts is None else counts
        width = rows.shape[1]
        most = max(counts)
        padded = torch.zeros(most, width, dtype=rows.dtype, device=rows.device)
        padded[:rows.shape[0]] = rows
        parts = [torch.empty_like(padded) for _ in range(self.dp_size * self.attn_tp_size)]
        dist.all_gather(parts, padded, group=self.tp_group)
        self.traffic["all_gather"] += padded.numel() * padded.element_size()
        # ranks of one group hold the same rows: take the first rank of each
        return torch.cat([parts[g * self.attn_tp_size][:n] for g, n in enumerate(counts)])

    def mine(self, all_rows: torch.Tensor) -> torch.Tensor:
        """This group's rows of a tensor laid out like `gather`'s result."""
        start = sum(self.shape.tokens[:self.dp_rank])
        return all_rows[start:start + self.shape.tokens[self.dp_rank]]

    def empty(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(0, width, dtype=dtype, device=self.device)

    def split_logits(self, logits: torch.Tensor) -> list[torch.Tensor]:
        """Rank 0: every group's logits rows (as gathered) split per group."""
        return list(logits.split(self.shape.sampled))


@dataclass
class DPStep:
    """One step of every DP group: group g's plan (engine.scheduler.SchedulerOutput) or None when
    it has nothing to run. Rank 0 broadcasts it; each rank runs its own group's part."""

    batches: list

    def shape(self) -> StepShape:
        tokens, sampled = [], []
        for batch in self.batches:
            if batch is None:
                tokens.append(0)
                sampled.append(0)
                continue
            tokens.append(len(batch.decodes) + sum(len(chunk.token_ids) for chunk in batch.extends))
            sampled.append(len(batch.sampled_chunks()))
        return StepShape(tokens, sampled)


class DPRankRunner:
    """A rank's model runner under DP attention: runs its group's part of a DPStep (or only the
    MLP collectives when its group is idle). Returns, on rank 0, every group's logits in group
    order (rows per group: `DPStep.shape().sampled`); None elsewhere."""

    def __init__(self, runner: ModelRunner, comm: DPAttentionComm) -> None:
        self.runner = runner
        self.comm = comm

    def step(self, plan: DPStep) -> torch.Tensor | None:
        self.comm.set_step(plan.shape())
        mine = plan.batches[self.comm.dp_rank]
        if mine is None or mine.is_empty:
            return self.runner.model.idle_forward()
        return self.runner.step(mine)
