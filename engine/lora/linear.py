"""A decoder projection with LoRA: the base `Linear`'s output plus each row's adapter delta (and
the routed experts' hook, engine.lora.experts)."""

from __future__ import annotations

import torch

from engine.lora.experts import wrap_experts
from engine.lora.slots import MLA_PROJECTIONS, LoraSlots, ProjectionLora
from engine.models.decoder import DecoderModel
from engine.models.linear import Linear


class LoraLinear(Linear):
    """Wraps a loaded projection (the base weights stay as they were packed); rows whose slot is -1,
    and whole steps without adapters, get the base output unchanged."""

    def __init__(self, base: Linear, slots: LoraSlots, lora: ProjectionLora) -> None:
        # Linear's own state is the base's: this object only delegates to it.
        self.base = base
        self.out_features, self.in_features = base.out_features, base.in_features
        self.slots = slots
        self.lora = lora

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.slots.row_slots is None:  # a step of the base model only
            return out
        rows = x.reshape(-1, self.in_features)
        self.slots.add_delta(self.lora, rows, out.view(-1, self.out_features))
        return out


def wrap_model(model: DecoderModel, slots: LoraSlots) -> None:
    """Put LoRA wrappers on every projection the slot pool has weights for."""
    for index, layer in enumerate(model.layers):
        for name in ("qkv", "o_proj", "gate_up", "down"):
            lora = slots.projections.get((index, name))
            base = getattr(layer, name)
            if lora is not None and base is not None:
                setattr(layer, name, LoraLinear(base, slots, lora))
        if layer.mla is not None:
            for name in MLA_PROJECTIONS:
                lora = slots.projections.get((index, name))
                base = getattr(layer.mla, name)
                if lora is not None and base is not None:
                    setattr(layer.mla, name, LoraLinear(base, slots, lora))
        if layer.moe is not None and any((index, name) in slots.expert_pools for name in ("gate_up", "down")):
            if layer.moe.ep is not None:  # expert parallelism: no expert adapters (register refuses them)
                slots.expert_pools.clear()
            else:
                wrap_experts(layer.moe, slots, index)
