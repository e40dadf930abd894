"""The Qwen2-VL, Qwen2.5-VL and Qwen3-VL vision towers, with the checkpoint's weights; `load_vision_tower`
picks a checkpoint's tower (LLaVA's CLIP one is engine.models.vision_clip).

The Qwen towers are transformers' own Qwen2VisionTransformerPretrainedModel,
Qwen2_5_VisionTransformerPretrainedModel and Qwen3VLVisionModel (the field's usual library for
this module; the decoder stays pdserve's): patch embedding, ViT blocks with 2-D rotary attention
(Qwen2.5-VL's: RMSNorm, gated MLPs, window attention but in its fullatt_block_indexes; Qwen3-VL's:
learned position embeddings interpolated to the grid, and deepstack mergers after some blocks),
and the merger that turns each 2x2 window of patches into one decoder-width token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from engine.models.config import ModelConfig
from engine.models.weights import CheckpointReader
from engine.multimodal.inputs import ImageInput

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel  # imported where used: it is slow to import

# transformers 5 saves the tower as model.visual.*, older Qwen2-VL checkpoints as visual.*
_PREFIXES = ("model.visual.", "visual.")


class Tower(Protocol):
    merge_size: int  # patches per side of one image token (1: one token per patch)

    def encode(self, images: Sequence[ImageInput]) -> torch.Tensor: ...


def load_vision_tower(model_dir: str, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> Tower:
    """The tower of a vision-language checkpoint (config.is_multimodal)."""
    if config.architecture == "LlavaForConditionalGeneration":
        from engine.models.vision_clip import ClipTower

        return ClipTower.load(model_dir, dtype, device)
    return VisionTower.load(model_dir, config, dtype, device)


def tower_merge_size(config: ModelConfig) -> int:
    """Patches per side of one image token, from config.json alone: a --language-only worker loads no
    tower but must expand and hash image prompts exactly as the tower's worker does."""
    if config.architecture == "LlavaForConditionalGeneration":
        return 1  # one token per CLIP patch (engine.models.vision_clip)
    return int(_vision_config(config).get("spatial_merge_size", 2))


def _vision_config(config: ModelConfig) -> dict:
    if config.vision_config is None:
        raise ValueError(f"{config.architecture} is not a vision-language model (no vision_config)")
    return config.vision_config


def tower_state(model_dir: str, prefixes: Sequence[str], what: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the first of `prefixes` it has, the prefix removed."""
    reader = CheckpointReader(model_dir)
    try:
        prefix = next((p for p in prefixes if any(n.startswith(p) for n in reader.names())), None)
        if prefix is None:
            raise ValueError(f"{model_dir}: a checkpoint without {what} weights ({' or '.join(prefixes)}*)")
        return {name.removeprefix(prefix): reader.get(name) for name in list(reader.names())
                if name.startswith(prefix)}
    finally:
        reader.close()


def load_module(module: torch.nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    missing, unexpected = module.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{what} weights do not match its config: missing {missing[:4]}, unexpected "
                         f"{unexpected[:4]}")


def _qwen_classes(architecture: str) -> tuple[type[PreTrainedConfig], type[PreTrainedModel]]:
    if architecture == "Qwen3VLForConditionalGeneration":
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        return Qwen3VLVisionConfig, Qwen3VLVisionModel
    if architecture == "Qwen2_5_VLForConditionalGeneration":
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )

        return Qwen2_5_VLVisionConfig, Qwen2_5_VisionTransformerPretrainedModel
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    return Qwen2VLVisionConfig, Qwen2VisionTransformerPretrainedModel


class VisionTower:
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL: images -> embeddings [sum of each image's tokens,
    hidden_size * (1 + deepstack layers)], in the model's dtype."""

    def __init__(self, module: torch.nn.Module, merge_size: int) -> None:
        self.module = module
        self.merge_size = merge_size
        self.dtype = next(module.parameters()).dtype
        self.device = next(module.parameters()).device

    @classmethod
    def load(cls, model_dir: str, config: ModelConfig, dtype: torch.dtype,
             device: torch.device) -> VisionTower:
        config_class, module_class = _qwen_classes(config.architecture)
        vision_config = config_class(**_vision_config(config))
        state = tower_state(model_dir, _PREFIXES, "vision tower")
        # Built for real (not on `meta`): its rotary inverse frequencies are buffers the checkpoint
        # does not hold, computed by the module's own constructor.
        module = module_class._from_config(vision_config, dtype=dtype)
        load_module(module, state, "vision tower")
        module = module.to(device=device, dtype=dtype).eval()
        return cls(module, vision_config.spatial_merge_size)

    @torch.inference_mode()
    def encode(self, images: Sequence[ImageInput]) -> torch.Tensor:
        pixels = torch.cat([i.pixel_values for i in images]).to(self.device, self.dtype)
        grid = torch.tensor([i.grid_thw for i in images], dtype=torch.long, device=self.device)
        out = self.module(pixels, grid_thw=grid)
        deepstack = getattr(out, "deepstack_features", None)
        # Qwen3-VL: each row [embedding, layer 0's deepstack feature, ...] (the decoder splits it)
        if deepstack:
            return torch.cat([out.pooler_output, *deepstack], dim=-1)
        return getattr(out, "pooler_output", out)
