"""ExpertParallel: whole experts per rank, tokens sent to their experts' owners and back (all-to-all).

Layout (engine.tp.topology): inside a pipeline stage the experts split into ep_size contiguous
blocks; EP rank r owns experts [r * E / ep, (r + 1) * E / ep), each of them split by columns over
the moe_tp_size ranks that share the block (`expert_shard`). A rank exchanges tokens only with the
ranks of its `group` (TPGroup.ep_group): one per expert block, all with its own moe_tp rank, so the
partial outputs of a column split come back to the rank that holds the matching partial sums.

One MoE layer, on every rank of the group together (engine.models.moe.MoEBlock calls it):
1. dispatch: the (token, expert) pairs of this rank's tokens are sorted by expert id (stable), so
   each owner's pairs are one contiguous run, grouped by its local expert; the per-expert counts go
   first (all_to_all_single of E int64s), then the pairs' hidden rows (all_to_all_single with those
   split sizes). Routing weights never travel: the origin applies them.
2. each owner runs its local experts once on all the rows it received (from every origin), either
   as per-expert Linears or as the fused C++ op over its stacked weights (`run_experts`).
3. combine: the unweighted expert outputs go back the way they came (all_to_all_single again); the
   origin multiplies each by its routing weight, rounds to the model dtype and adds a token's pairs
   in increasing expert id with one index_add_, exactly as engine.models.moe.routed_experts_torch
   does, so an expert's result for a token is the one TP 1 computes.

Two entry points: `replicated` for tokens every TP rank holds (no DP attention: each EP rank takes
a contiguous 1/ep of the rows, the others' rows are zero in its output and the decoder's TP
all-reduce completes them) and `local` for tokens that are this rank's own (DP attention): no
slicing, no zero fill.

Every call is a collective over `group`: all of its ranks call it for the same layers in the same
order, also with no tokens (a rank's slice of a short step may be empty).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from engine.tp.group import TPGroup
from engine.tp.shard import TPShard

# (rows [N, hidden] grouped by local expert, counts [E_local]) -> the experts' outputs [N, hidden],
# unweighted, in the same row order.
RunExperts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ExpertParallel:
    """One rank's place in expert parallelism and its dispatch/combine over `group`.

    `sent_bytes` and `received_bytes` count the bytes this rank's all-to-alls sent to and received
    from the other ranks since load (counts, hidden rows out and results back, over all MoE layers;
    not what a rank hands itself); diff them around a step for that step's traffic. Each row goes
    out and comes back, so the two are equal on every rank.
    """

    def __init__(self, ep_rank: int, ep_size: int, num_experts: int, group: dist.ProcessGroup | None,
                 expert_shard: TPShard) -> None:
        if num_experts % ep_size:
            raise ValueError(f"--ep-size {ep_size} does not divide the model's {num_experts} experts")
        # ep_rank is also this rank's index in `group`: TPGroup lists an EP group's ranks by block.
        self.ep_rank, self.ep_size = ep_rank, ep_size
        self.num_experts = num_experts
        self.num_local = num_experts // ep_size
        self.first_expert = ep_rank * self.num_local
        self.group = group  # None: the whole world is the EP group
        self.expert_shard = expert_shard  # columns of each local expert over the moe_tp ranks
        self.sent_bytes = 0
        self.received_bytes = 0

    @classmethod
    def for_rank(cls, group: TPGroup, num_experts: int) -> ExpertParallel:
        topology = group.topology
        return cls(topology.ep_rank(group.rank), topology.ep_size, num_experts, group.ep_group,
                   TPShard(topology.moe_tp_rank(group.rank), topology.moe_tp_size))

    @property
    def local_experts(self) -> range:
        return range(self.first_expert, self.first_expert + self.num_local)

    def token_slice(self, num_tokens: int) -> slice:
        """This EP rank's contiguous share of `num_tokens` replicated rows (may be empty)."""
        return slice(num_tokens * self.ep_rank // self.ep_size,
                     num_tokens * (self.ep_rank + 1) // self.ep_size)

    def replicated(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                   run_experts: RunExperts) -> torch.Tensor:
        """Routed-expert output [T, hidden] for tokens every TP rank holds (`ids`/`weights` [T, k] for
        all of them): this rank's slice of rows filled, every other row zero (the TP all-reduce sums
        the slices)."""
        rows = self.token_slice(x.shape[0])
        out = torch.zeros_like(x)
        out[rows] = self.local(x[rows], ids[rows], weights[rows], run_experts)
        return out

    def local(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              run_experts: RunExperts) -> torch.Tensor:
        """Routed-expert output [T, hidden] for this rank's own tokens x [T, hidden]."""
        top_k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, so by owner
        rows_of_pairs = order // top_k
        send_counts = torch.bincount(flat, minlength=self.num_experts)  # [ep * E_local]
        recv_counts = torch.empty_like(send_counts)  # [source, local expert] flattened
        self._exchange(recv_counts, send_counts)
        send_split = send_counts.view(self.ep_size, self.num_local).sum(1).tolist()
        by_source = recv_counts.view(self.ep_size, self.num_local)
        recv_split = by_source.sum(1).tolist()

        received = x.new_empty((sum(recv_split), x.shape[1]))
        self._exchange(received, x[rows_of_pairs], recv_split, send_split)
        outputs = self._run_local(received, by_source, run_experts)
        returned = x.new_empty((len(rows_of_pairs), x.shape[1]))
        self._exchange(returned, outputs, send_split, recv_split)

        weighted = (returned * weights.reshape(-1, 1)[order]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, rows_of_pairs, weighted)

    def _run_local(self, received: torch.Tensor, by_source: torch.Tensor,
                   run_experts: RunExperts) -> torch.Tensor:
        """Run the local experts on rows arriving source by source, each source's grouped by local
        expert; regroup so that each expert runs once on all its rows, then restore arrival order."""
        local_ids = torch.arange(self.num_local, device=received.device).repeat(self.ep_size)
        local_ids = local_ids.repeat_interleave(by_source.reshape(-1))
        regroup = torch.argsort(local_ids, stable=True)
        outputs = torch.empty_like(received)
        outputs[regroup] = run_experts(received[regroup], by_source.sum(0))
        return outputs

    def _exchange(self, output: torch.Tensor, input: torch.Tensor, output_split: list[int] | None = None,
                  input_split: list[int] | None = None) -> None:
        """all_to_all_single over the group (None splits: equal parts), counting the bytes that
        leave and reach this rank (not the part it sends itself)."""
        dist.all_to_all_single(output, input.contiguous(), output_split, input_split, group=self.group)
        row_bytes = math.prod(input.shape[1:]) * input.element_size()
        kept_rows = input_split[self.ep_rank] if input_split is not None else input.shape[0] // self.ep_size
        kept = kept_rows * row_bytes
        self.sent_bytes += input.numel() * input.element_size() - kept
        self.received_bytes += output.numel() * output.element_size() - kept
