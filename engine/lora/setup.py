"""Turning an engine's LoRA flags into a slot pool over its loaded model."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.lora.adapter import SUPPORTED_MODULES, check_servable, load_adapter, parse_lora_paths
from engine.lora.linear import wrap_model
from engine.lora.slots import LoraSlots
from engine.models.config import ModelConfig
from engine.models.decoder import DecoderModel
from engine.tp.shard import TPShard


def target_modules(config: EngineConfig) -> frozenset[str]:
    """--lora-target-modules, checked (`all`, or none given, is every supported module)."""
    given = set(config.lora_target_modules)
    if not given or given == {"all"}:
        return frozenset(SUPPORTED_MODULES)
    unknown = sorted(given - set(SUPPORTED_MODULES))
    if unknown:
        raise ValueError(f"--lora-target-modules: {', '.join(unknown)} not among "
                         f"{', '.join(SUPPORTED_MODULES)}")
    return frozenset(given)


def check_lora_flags(config: EngineConfig) -> None:
    if not config.enable_lora:
        flags = (("--lora-paths", config.lora_paths), ("--lora-resolver-dir", config.lora_resolver_dir))
        for flag, value in flags:
            if value:
                raise ValueError(f"{flag} needs --enable-lora")
        return
    if config.lora_resolver_dir and not Path(config.lora_resolver_dir).is_dir():
        raise ValueError(f"--lora-resolver-dir {config.lora_resolver_dir}: not a directory")
    if config.pp_size > 1 or config.enable_dp_attention:
        raise ValueError("--enable-lora runs on one pipeline stage without DP attention for now "
                         "(--pp-size 1; --tp-size N shards the adapters like their base layers)")
    if config.max_loras_per_batch < 1 or config.max_lora_rank < 1:
        raise ValueError("--max-loras-per-batch and --max-lora-rank must be positive")
    target_modules(config)
    parse_lora_paths(config.lora_paths)


def attach_lora(config: EngineConfig, model_config: ModelConfig, model: DecoderModel,
                dtype: torch.dtype, device: torch.device, shard: TPShard | None = None) -> LoraSlots:
    """The slot pool for `model` (wrapped in place; this rank's `shard` of it under tensor
    parallelism) with the --lora-paths adapters registered."""
    check_lora_flags(config)
    check_servable(model_config)
    slots = LoraSlots(model_config, config.max_loras_per_batch, config.max_lora_rank, target_modules(config),
                      dtype, device, cpu_kernel=config.cpu_kernels != "off", shard=shard)
    slots.resolver_dir = config.lora_resolver_dir
    for name, path in parse_lora_paths(config.lora_paths).items():
        slots.register(load_adapter(name, path, model_config, config.max_lora_rank, slots.target_modules))
    wrap_model(model, slots)
    return slots
