"""Qwen2-VL's vision tower, with the checkpoint's weights.

The tower is transformers' own Qwen2VisionTransformerPretrainedModel (the field's usual library
for this module; the decoder stays pdserve's): patch embedding, ViT blocks with 2-D rotary
attention, and the merger that turns each 2x2 window of patches into one decoder-width token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.models.config import ModelConfig
from engine.models.weights import CheckpointReader
from engine.multimodal.inputs import ImageInput

# transformers 5 saves the tower as model.visual.*, older Qwen2-VL checkpoints as visual.*
_PREFIXES = ("model.visual.", "visual.")


class VisionTower:
    """Images -> embeddings [sum of each image's tokens, hidden_size], in the model's dtype."""

    def __init__(self, module: torch.nn.Module, merge_size: int) -> None:
        self.module = module
        self.merge_size = merge_size
        self.dtype = next(module.parameters()).dtype
        self.device = next(module.parameters()).device

    @classmethod
    def load(cls, model_dir: str, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> VisionTower:
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

        vision_config = Qwen2VLVisionConfig(**config.vision_config)  # type: ignore[arg-type]
        reader = CheckpointReader(model_dir)
        prefix = next((p for p in _PREFIXES if any(n.startswith(p) for n in reader.names())), None)
        if prefix is None:
            raise ValueError(f"{model_dir}: a {config.architecture} checkpoint without vision tower weights")
        state = {name.removeprefix(prefix): reader.get(name) for name in list(reader.names()) if name.startswith(prefix)}
        reader.close()
        # Built for real (not on `meta`): its rotary inverse frequencies are buffers the checkpoint
        # does not hold, computed by the module's own constructor.
        module = Qwen2VisionTransformerPretrainedModel._from_config(vision_config, dtype=dtype)
        missing, unexpected = module.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"vision tower weights do not match its config: missing {missing[:4]}, "
                             f"unexpected {unexpected[:4]}")
        module = module.to(device=device, dtype=dtype).eval()
        return cls(module, vision_config.spatial_merge_size)

    @torch.inference_mode()
    def encode(self, images: Sequence[ImageInput]) -> torch.Tensor:
        pixels = torch.cat([i.pixel_values for i in images]).to(self.device, self.dtype)
        grid = torch.tensor([i.grid_thw for i in images], dtype=torch.long, device=self.device)
        out = self.module(pixels, grid_thw=grid)
        return getattr(out, "pooler_output", out)

