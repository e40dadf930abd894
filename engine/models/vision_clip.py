"""LLaVA's image encoder: a CLIP vision transformer and the multimodal projector, with the
checkpoint's weights.

Both are transformers' own modules (CLIPVisionModel, LlavaMultiModalProjector; the decoder stays
pdserve's). As transformers' LlavaModel.get_image_features: the hidden states of
`vision_feature_layer` (LLaVA-1.5: the second to last), without the CLS token under the
"default" strategy, through the projector (linear, GELU, linear) to the decoder's width: one
token per patch. Images arrive patchified (engine.multimodal.clip_processor) and are put back
together here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from engine.models.vision import load_module, tower_state
from engine.multimodal.inputs import ImageInput

# transformers 5 saves LLaVA as model.vision_tower.* / model.multi_modal_projector.*, older
# checkpoints without the "model." prefix
_TOWER = ("model.vision_tower.", "vision_tower.")
_PROJECTOR = ("model.multi_modal_projector.", "multi_modal_projector.")
STRATEGIES = ("default",)  # "full" (CLS kept) would take one more token than the patches


class ClipTower:
    """Images -> embeddings [images * patches, hidden_size]."""

    merge_size = 1

    def __init__(self, tower: torch.nn.Module, projector: torch.nn.Module, feature_layer: int, strategy: str,
                 patch_size: int) -> None:
        self.tower = tower
        self.projector = projector
        self.feature_layer = feature_layer
        self.strategy = strategy
        self.patch_size = patch_size
        self.dtype = next(tower.parameters()).dtype
        self.device = next(tower.parameters()).device

    @classmethod
    def load(cls, model_dir: str, dtype: torch.dtype, device: torch.device) -> ClipTower:
        from transformers import CLIPVisionModel, LlavaConfig, PreTrainedConfig
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        raw = json.loads((Path(model_dir) / "config.json").read_text())
        config = LlavaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
        # LlavaConfig builds its vision_config (a dict or None given) into a config object
        vision_config = config.vision_config
        if not isinstance(vision_config, PreTrainedConfig):
            raise ValueError(f"LlavaConfig left vision_config a {type(vision_config).__name__}")
        if vision_config.model_type != "clip_vision_model":
            raise ValueError(f"LLaVA with a {vision_config.model_type!r} vision tower is not supported; "
                             "implemented: clip_vision_model")
        if not isinstance(config.vision_feature_layer, int):
            raise ValueError("LLaVA with several vision_feature_layer values is not supported")
        if config.vision_feature_select_strategy not in STRATEGIES:
            raise ValueError(f"vision_feature_select_strategy {config.vision_feature_select_strategy!r} is "
                             f"not supported; implemented: {', '.join(STRATEGIES)}")
        tower = CLIPVisionModel._from_config(vision_config, dtype=dtype)
        # CLIPVisionModel's own names start at vision_model.*, as the checkpoint's under its prefix
        load_module(tower, tower_state(model_dir, _TOWER, "vision tower"), "vision tower")
        projector = LlavaMultiModalProjector(config).to(dtype)
        load_module(projector, tower_state(model_dir, _PROJECTOR, "multimodal projector"),
                    "multimodal projector")
        return cls(tower.to(device).eval(), projector.to(device).eval(), config.vision_feature_layer,
                   config.vision_feature_select_strategy, vision_config.patch_size)

    @torch.inference_mode()
    def encode(self, images: Sequence[ImageInput]) -> torch.Tensor:
        pixels = torch.stack([unpatchify(i, self.patch_size) for i in images]).to(self.device, self.dtype)
        out = self.tower(pixels, output_hidden_states=True)
        features = out.hidden_states[self.feature_layer]
        if self.strategy == "default":
            features = features[:, 1:]
        return self.projector(features).flatten(0, 1)


def unpatchify(image: ImageInput, patch: int) -> torch.Tensor:
    """An image's patches [gh * gw, C * P * P] (row-major) -> pixels [C, gh * P, gw * P]."""
    _, grid_h, grid_w = image.grid_thw
    channels = image.pixel_values.shape[1] // (patch * patch)
    x = image.pixel_values.view(grid_h, grid_w, channels, patch, patch)
    return x.permute(2, 0, 3, 1, 4).reshape(channels, grid_h * patch, grid_w * patch)
