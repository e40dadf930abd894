"""LoRA on routed experts: every resident adapter's per-expert A and B, and the hook a MoE block calls.

For each routed layer and each fused expert parameter (gate_up, down) the pool keeps `a`
[E, S * R, in] and `bt` [E, S * R, out] (B transposed, the adapter's scaling folded in), R being
--max-lora-rank and S the slot count: expert e's slot s block is rows s*R.. of a[e] and bt[e], the
layout of engine.lora.ops for one projection. The MoE block groups a step's (token, expert) pairs by
expert (engine.models.moe.run_grouped_experts); each expert's run then gets
`((x @ a[e].T) * hit) @ bt[e]`, `hit` being 1 on the columns of the pair's slot: one pair of
products per expert and projection, whatever the mix of adapters (no loop over adapters or rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.lora.expert_adapter import expert_shapes
from engine.models.linear import Linear
from engine.models.moe import ExpertDelta, MoEBlock

if TYPE_CHECKING:
    from engine.lora.adapter import LoraAdapter
    from engine.lora.slots import LoraSlots

# The engine's name of each fused expert projection and PEFT's parameter it holds.
EXPERT_PROJECTIONS = {"gate_up": "gate_up_proj", "down": "down_proj"}


@dataclass
class ExpertProjectionLora:
    """One routed layer's LoRA weights of one expert projection over all slots."""

    a: torch.Tensor  # [E, num_slots * max_rank, in]
    bt: torch.Tensor  # [E, num_slots * max_rank, out]: scaling * B transposed

    @classmethod
    def allocate(cls, num_experts: int, num_slots: int, max_rank: int, out_features: int, in_features: int,
                 dtype: torch.dtype, device: torch.device) -> ExpertProjectionLora:
        rows = num_slots * max_rank
        return cls(torch.zeros(num_experts, rows, in_features, dtype=dtype, device=device),
                   torch.zeros(num_experts, rows, out_features, dtype=dtype, device=device))

    def fill(self, slot: int, adapter: LoraAdapter | None, layer: int, parameter: str, max_rank: int) -> None:
        """Copy `adapter`'s weights of this layer's `parameter` into `slot` (zeros where it has none)."""
        rows = slice(slot * max_rank, (slot + 1) * max_rank)
        self.a[:, rows].zero_()
        self.bt[:, rows].zero_()
        weights = adapter.experts.get((layer, parameter)) if adapter is not None else None
        if weights is None:
            return
        rank = weights.a.shape[1]
        first = slot * max_rank
        self.a[:, first:first + rank] = weights.a.to(self.a.dtype)
        self.bt[:, first:first + rank] = (weights.b.transpose(1, 2) * weights.scaling).to(self.bt.dtype)


def allocate_expert_pools(slots: LoraSlots) -> dict[tuple[int, str], ExpertProjectionLora]:
    """(routed layer, "gate_up" or "down") -> its pool, for the projections --lora-target-modules allows."""
    config = slots.config
    if config.moe is None:
        return {}
    shapes = expert_shapes(config)
    allowed = {"gate_up": {"gate_proj", "up_proj"} <= slots.target_modules,
               "down": "down_proj" in slots.target_modules}
    num_experts = config.moe.num_experts
    return {(layer, name): ExpertProjectionLora.allocate(num_experts, slots.num_slots, slots.max_rank,
                                                         *shapes[parameter], slots.dtype, slots.device)
            for layer in config.moe.sparse_layers for name, parameter in EXPERT_PROJECTIONS.items()
            if allowed[name]}


class ExpertLoraHook:
    """A MoE block's `adapters` (engine.models.moe.ExpertAdapters): this step's rows' slots from the
    slot pool, the layer's pools from `pools`."""

    def __init__(self, slots: LoraSlots, layer: int) -> None:
        self.slots = slots
        self.layer = layer

    def bind(self, pair_rows: torch.Tensor) -> ExpertDelta | None:
        row_slots = self.slots.row_slots
        if row_slots is None:
            return None
        pair_slots = row_slots[pair_rows]
        pools = {name: self.slots.expert_pools.get((self.layer, name)) for name in EXPERT_PROJECTIONS}
        max_rank = self.slots.max_rank
        column_slot = torch.arange(self.slots.num_slots, device=pair_slots.device).repeat_interleave(max_rank)
        hits: dict[torch.dtype, torch.Tensor] = {}

        def add(expert: int, name: str, start: int, x: torch.Tensor, out: torch.Tensor) -> None:
            pool = pools[name]
            if pool is None:
                return
            hit = hits.get(x.dtype)
            if hit is None:
                hit = hits[x.dtype] = (pair_slots.unsqueeze(1) == column_slot.unsqueeze(0)).to(x.dtype)
            rows = hit[start:start + x.shape[0]]
            out.add_(torch.mm(torch.mm(x, pool.a[expert].t()) * rows, pool.bt[expert]))

        return add


def wrap_experts(block: MoEBlock, slots: LoraSlots, layer: int) -> None:
    """Give `block` the LoRA hook; experts stacked for the fused C++ op are split back into per-expert
    Linears first (the hook runs on the torch path)."""
    if block.ep is not None:
        raise ValueError("LoRA on routed experts does not run with expert parallelism (--ep-size 1)")
    if block.stacked is not None:
        gate_up, down = block.stacked
        block.experts = [(Linear(gate_up[e]), Linear(down[e])) for e in range(gate_up.shape[0])]
        block.stacked = None
    block.adapters = ExpertLoraHook(slots, layer)
