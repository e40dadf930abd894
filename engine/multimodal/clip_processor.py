"""CLIP image preprocessing (LLaVA): PIL image -> patches, without torchvision.

Follows transformers' CLIPImageProcessor (its PIL backend): resize so the shorter side is
`shortest_edge` (the longer one int(shortest_edge * long / short)), bicubic; center-crop to
`crop_size` (zero-padding first where the image is smaller, as transformers' center_crop);
rescale by 1/255; normalize by the processor's mean/std. The [C, H, W] result is cut into the
tower's patch grid, patches row-major, so an image travels as an ImageInput like Qwen's (the
tower puts it back together: engine.models.vision_clip.unpatchify). Every image takes the same
(crop / patch)**2 tokens.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from engine.multimodal.image_processor import CLIP_MEAN, CLIP_STD
from engine.multimodal.inputs import ImageInput

_RESAMPLE = {0: Image.Resampling.NEAREST, 1: Image.Resampling.LANCZOS, 2: Image.Resampling.BILINEAR,
             3: Image.Resampling.BICUBIC}


@dataclass(frozen=True)
class ClipProcessorConfig:
    """The fields of a CLIPImageProcessor preprocessor_config.json that preprocessing uses;
    `patch_size` is the vision tower's (config.json's vision_config)."""

    shortest_edge: int = 336
    crop_height: int = 336
    crop_width: int = 336
    patch_size: int = 14
    resample: int = 3
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    merge_size: int = 1  # one image token per patch

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ClipProcessorConfig:
        """From preprocessor_config.json; without one, CLIP's defaults at the tower's image_size."""
        model = json.loads((Path(model_dir) / "config.json").read_text())
        path = Path(model_dir) / "preprocessor_config.json"
        side = int(model.get("vision_config", {}).get("image_size", cls.shortest_edge))
        raw: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {
            "size": {"shortest_edge": side}, "crop_size": {"height": side, "width": side}}
        for flag in ("do_resize", "do_center_crop", "do_rescale", "do_normalize"):
            if raw.get(flag, True) is not True:
                raise ValueError(f"CLIP preprocessing with {flag} false is not supported")
        if raw.get("do_pad"):
            raise ValueError("LLaVA preprocessing with do_pad (pad to square) is not supported")
        size, crop = raw.get("size") or {}, raw.get("crop_size") or {}
        if isinstance(size, int):
            size = {"shortest_edge": size}
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        if "shortest_edge" not in size or "height" not in crop or "width" not in crop:
            raise ValueError(f"CLIP preprocessing needs size.shortest_edge and crop_size height/width, got "
                             f"size={size} crop_size={crop}")
        patch = int(model.get("vision_config", {}).get("patch_size", cls.patch_size))
        if crop["height"] % patch or crop["width"] % patch:
            raise ValueError(f"crop_size {crop} is not a multiple of the tower's patch size {patch}")
        resample = int(raw.get("resample", cls.resample))
        if resample not in _RESAMPLE:
            raise ValueError(f"unsupported resample {resample}; implemented: {sorted(_RESAMPLE)}")
        return cls(shortest_edge=int(size["shortest_edge"]), crop_height=int(crop["height"]),
                   crop_width=int(crop["width"]), patch_size=patch, resample=resample,
                   image_mean=tuple(raw.get("image_mean", CLIP_MEAN)),
                   image_std=tuple(raw.get("image_std", CLIP_STD)))

    def preprocess(self, image: Image.Image) -> ImageInput:
        return preprocess_clip(image, self)


def resized_size(height: int, width: int, shortest_edge: int) -> tuple[int, int]:
    """(height, width) with the shorter side `shortest_edge`, as transformers'
    get_resize_output_image_size(default_to_square=False)."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image has no pixels ({width}x{height})")
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = shortest_edge, int(shortest_edge * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """[C, H, W] -> [C, height, width] around the centre; zero-padded first where smaller."""
    _, orig_h, orig_w = pixels.shape
    if orig_h < height or orig_w < width:
        new_h, new_w = max(orig_h, height), max(orig_w, width)
        padded = np.zeros((pixels.shape[0], new_h, new_w), dtype=pixels.dtype)
        top, left = math.ceil((new_h - orig_h) / 2), math.ceil((new_w - orig_w) / 2)
        padded[:, top:top + orig_h, left:left + orig_w] = pixels
        pixels, orig_h, orig_w = padded, new_h, new_w
    top, left = (orig_h - height) // 2, (orig_w - width) // 2
    return pixels[:, top:top + height, left:left + width]


def preprocess_clip(image: Image.Image, config: ClipProcessorConfig) -> ImageInput:
    """One image's patches [gh * gw, C * P * P] (fp32), grid (1, gh, gw)."""
    image = image.convert("RGB")
    height, width = resized_size(image.height, image.width, config.shortest_edge)
    resized = image.resize((width, height), resample=_RESAMPLE[config.resample])
    pixels = np.asarray(resized).transpose(2, 0, 1)  # [C, H, W] uint8: crop before any arithmetic
    pixels = center_crop(pixels, config.crop_height, config.crop_width)
    pixels = (pixels.astype(np.float64) * (1.0 / 255.0)).astype(np.float32)
    mean = np.asarray(config.image_mean, np.float32)[:, None, None]
    std = np.asarray(config.image_std, np.float32)[:, None, None]
    pixels = (pixels - mean) / std
    patch = config.patch_size
    channels, crop_h, crop_w = pixels.shape
    grid_h, grid_w = crop_h // patch, crop_w // patch
    patches = pixels.reshape(channels, grid_h, patch, grid_w, patch).transpose(1, 3, 0, 2, 4)
    rows = np.ascontiguousarray(patches.reshape(grid_h * grid_w, -1))
    return ImageInput.from_pixels(torch.from_numpy(rows), (1, grid_h, grid_w))
