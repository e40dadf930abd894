"""A random-weight LoRA adapter folder in PEFT's format for a local checkpoint (no peft needed):
adapter_config.json and adapter_model.safetensors, as `PeftModel.save_pretrained` writes them."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.lora.adapter import module_shape
from engine.lora.expert_adapter import EXPERT_PARAMETERS, expert_shapes
from engine.models.config import ModelConfig

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(model_dir: str | Path, out_dir: str | Path, rank: int = 16,
                         targets: tuple[str, ...] = ALL_TARGETS, alpha: float = 32.0, seed: int = 0,
                         std: float = 0.02) -> Path:
    """Write an adapter of `rank` on `targets` of every layer (on a MoE model's routed layers MLP
    targets adapt every expert, as PEFT's target_parameters do)."""
    config = ModelConfig.from_dir(str(model_dir))
    sparse = set(config.moe.sparse_layers) if config.moe is not None else set()
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module in targets:
            block = "self_attn" if module in ALL_TARGETS[:4] else "mlp"
            if block == "mlp" and layer in sparse:
                continue  # the routed experts: below, as PEFT's target_parameters
            out_features, in_features = module_shape(config, module)
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * std
    # A routed layer's fused expert parameters: every expert's rank block in one wrapper each, nested
    # as PEFT saves two wrappers on one module (engine.lora.expert_adapter)
    parameters = [p for p, modules in EXPERT_PARAMETERS.items() if set(modules) <= set(targets)]
    shapes = expert_shapes(config)
    for layer in sorted(sparse) if config.moe is not None else []:
        for depth, parameter in enumerate(parameters):
            out_features, in_features = shapes[parameter]
            width = rank * config.moe.num_experts
            prefix = f"base_model.model.model.layers.{layer}.mlp.experts.{'base_layer.' * depth}"
            tensors[f"{prefix}lora_A.weight"] = torch.randn(width, in_features, generator=generator) * std
            tensors[f"{prefix}lora_B.weight"] = torch.randn(out_features, width, generator=generator) * std
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
        "target_parameters": [f"mlp.experts.{p}" for p in parameters] if sparse else None,
        "lora_dropout": 0.0, "bias": "none", "base_model_name_or_path": str(model_dir)}, indent=2))
    return out
