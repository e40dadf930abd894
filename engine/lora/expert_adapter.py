"""A PEFT adapter's LoRA on a MoE layer's routed experts, read and checked.

transformers 5 keeps a MoE layer's experts as two fused parameters, `mlp.experts.gate_up_proj`
[E, 2 * I, hidden] and `mlp.experts.down_proj` [E, hidden, I], so PEFT adapts them through
`target_parameters` (it also rewrites a plain `target_modules` of gate_proj/up_proj/down_proj into
that). One wrapper per parameter; two on one module nest, so the file names them by position, not by
parameter: `mlp.experts.lora_A.weight`, `mlp.experts.base_layer.lora_A.weight`, ... Which parameter a
pair adapts is read from its shapes (gate_up: in hidden, out 2 * I; down: in I, out hidden; never
both). Each pair holds every expert's rank-r block: A [E * r, in] (expert e's rows e*r..), B
[out, r * E] (expert e's columns e, e + E, ...: PEFT's `reshape(out, r, E)`).

A parameter's rank and alpha are PEFT's per-parameter ones: `rank_pattern` / `alpha_pattern` entries
matching `mlp.experts.<parameter>` (PEFT writes `.*\\.gate_up_proj` at twice the rank and alpha when
it fuses gate_proj and up_proj targets), else r and lora_alpha.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from engine.models.config import ModelConfig

# The PEFT module names each fused expert parameter stands for (what --lora-target-modules filters on).
EXPERT_PARAMETERS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}

EXPERT_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.mlp\.experts\.((?:base_layer\.)*)"
                        r"lora_([AB])\.weight$")


@dataclass(frozen=True)
class ExpertLoraWeights:
    """One routed layer's adapter on one fused expert parameter: A [E, rank, in], B [E, out, rank]."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float


def expert_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of one expert's fused parameters."""
    if config.moe is None:
        return {}
    hidden, width = config.hidden_size, config.moe.intermediate_size
    return {"gate_up_proj": (2 * width, hidden), "down_proj": (hidden, width)}


def pattern_value(patterns: dict, name: str) -> object | None:
    """PEFT's per-module override for `name` (a pattern matching the end of its dotted name)."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", name):
            return value
    return None


def split_experts(adapter_name: str, layer: int, halves: dict[str, torch.Tensor], config: ModelConfig,
                  peft: dict, error: type[ValueError]) -> tuple[str, ExpertLoraWeights]:
    """One wrapper's lora_A/lora_B (`halves`) of `layer`'s experts as (parameter, per-expert weights)."""
    if config.moe is None or layer not in config.moe.sparse_layers:
        raise error(f"LoRA adapter {adapter_name!r} targets mlp.experts of layer {layer}, which "
                    f"{config.architecture} routes to no experts (another base model?)")
    if set(halves) != {"A", "B"}:
        raise error(f"LoRA adapter {adapter_name!r}: layer {layer} mlp.experts has lora_{next(iter(halves))} "
                    "without its other half")
    a, b = halves["A"], halves["B"]
    num_experts = config.moe.num_experts
    shapes = expert_shapes(config)
    parameter = next((p for p, (out_f, in_f) in shapes.items() if a.shape[1] == in_f and b.shape[0] == out_f),
                     None)
    if parameter is None or a.shape[0] % num_experts or b.shape[1] != a.shape[0]:
        wanted = "; ".join(f"{p}: A (E*r, {i}) and B ({o}, E*r)" for p, (o, i) in shapes.items())
        raise error(f"LoRA adapter {adapter_name!r}: layer {layer} mlp.experts has A {tuple(a.shape)} and B "
                    f"{tuple(b.shape)}, which fit none of this model's {num_experts} experts' parameters "
                    f"({wanted}; an adapter of another base model?)")
    rank = a.shape[0] // num_experts
    full_name = f"model.layers.{layer}.mlp.experts.{parameter}"
    rank_value = pattern_value(peft.get("rank_pattern") or {}, full_name)
    want_rank = rank_value if rank_value is not None else peft.get("r")
    if rank != want_rank:
        raise error(f"LoRA adapter {adapter_name!r}: layer {layer} mlp.experts.{parameter} has rank {rank} "
                    f"per expert over {num_experts} experts, its config says {want_rank} "
                    "(another base model?)")
    alpha_value = pattern_value(peft.get("alpha_pattern") or {}, full_name)
    alpha = float(alpha_value if alpha_value is not None else peft.get("lora_alpha", 0))  # type: ignore[arg-type]
    scaling = alpha / math.sqrt(rank) if peft.get("use_rslora") else alpha / rank
    per_expert_a = a.reshape(num_experts, rank, a.shape[1])
    per_expert_b = b.reshape(b.shape[0], rank, num_experts).permute(2, 0, 1).contiguous()
    return parameter, ExpertLoraWeights(per_expert_a.contiguous(), per_expert_b, scaling)
