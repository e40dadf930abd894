"""Qwen2-VL image preprocessing: PIL image -> (pixel_values, grid_thw), without torchvision.

Follows transformers' Qwen2VLImageProcessor (the slow, PIL path): `smart_resize` to a size whose
sides are multiples of patch_size * merge_size with the pixel count kept within
[min_pixels, max_pixels], a bicubic resize, rescale by 1/255, normalize by the processor's
mean/std, then patchify: the image is repeated temporal_patch_size times (a still image is a
one-frame video) and cut into patches ordered merge-window by merge-window, each flattened as
[channel, time, row, column]. transformers' own processor needs torchvision, which this
environment cannot import; the model is checked exact against HF's given the same pixel_values.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from engine.multimodal.inputs import ImageInput

# Qwen2-VL's published preprocessor_config.json values (OpenAI CLIP's mean/std).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200  # as transformers: a thinner image is refused
_RESAMPLE = {0: Image.Resampling.NEAREST, 1: Image.Resampling.LANCZOS, 2: Image.Resampling.BILINEAR,
             3: Image.Resampling.BICUBIC}


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The fields of a Qwen2-VL preprocessor_config.json that preprocessing uses."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    resample: int = 3  # PIL's code: 3 bicubic (the processor's default), 2 bilinear, ...
    rescale_factor: float = 1 / 255

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ImageProcessorConfig:
        raw = json.loads((Path(model_dir) / "preprocessor_config.json").read_text())
        # Steps transformers' processor can skip but this one always runs: refused, not ignored.
        for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if raw.get(flag, True) is not True:
                raise ValueError(f"Qwen-VL preprocessing with {flag} false is not supported "
                                 "(preprocessor_config.json)")
        resample = int(raw.get("resample", cls.resample))
        if resample not in _RESAMPLE:
            raise ValueError(f"unsupported resample {resample!r} in preprocessor_config.json; "
                             f"implemented: {sorted(_RESAMPLE)}")
        size = raw.get("size") or {}
        return cls(min_pixels=int(raw.get("min_pixels") or size.get("shortest_edge") or cls.min_pixels),
                   max_pixels=int(raw.get("max_pixels") or size.get("longest_edge") or cls.max_pixels),
                   patch_size=int(raw.get("patch_size", cls.patch_size)),
                   merge_size=int(raw.get("merge_size", cls.merge_size)),
                   temporal_patch_size=int(raw.get("temporal_patch_size", cls.temporal_patch_size)),
                   image_mean=tuple(raw.get("image_mean", CLIP_MEAN)),
                   image_std=tuple(raw.get("image_std", CLIP_STD)), resample=resample,
                   rescale_factor=float(raw.get("rescale_factor", cls.rescale_factor)))

    def preprocess(self, image: Image.Image) -> ImageInput:
        return preprocess(image, self)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor`, scaled (keeping the aspect ratio) so the
    pixel count lies within [min_pixels, max_pixels]; ValueError for an extreme aspect ratio."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image has no pixels ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image aspect ratio must be below {MAX_ASPECT_RATIO}, got {width}x{height}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def preprocess(image: Image.Image, config: ImageProcessorConfig) -> ImageInput:
    """One image's pixel_values [grid_t * grid_h * grid_w, C * T * P * P] (fp32) and grid_thw."""
    image = image.convert("RGB")
    patch, merge, temporal = config.patch_size, config.merge_size, config.temporal_patch_size
    height, width = smart_resize(image.height, image.width, patch * merge, config.min_pixels,
                                 config.max_pixels)
    resized = image.resize((width, height), resample=_RESAMPLE[config.resample])
    scaled = np.asarray(resized, dtype=np.float32) * np.float32(config.rescale_factor)  # [H, W, C]
    pixels = (scaled - np.asarray(config.image_mean, np.float32)) / np.asarray(config.image_std, np.float32)
    frames = np.repeat(pixels.transpose(2, 0, 1)[None], temporal, axis=0)  # [T, C, H, W]
    return ImageInput.from_pixels(torch.from_numpy(patchify(frames, patch, merge, temporal)),
                                  (frames.shape[0] // temporal, height // patch, width // patch))


def patchify(frames: np.ndarray, patch: int, merge: int, temporal: int) -> np.ndarray:
    """[T, C, H, W] frames -> [grid_t * grid_h * grid_w, C * temporal * patch * patch], patches in
    the vision tower's order: each merge x merge window's patches consecutive."""
    frames_n, channels, height, width = frames.shape
    grid_t, grid_h, grid_w = frames_n // temporal, height // patch, width // patch
    x = frames.reshape(grid_t, temporal, channels, grid_h // merge, merge, patch, grid_w // merge, merge,
                       patch)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x.reshape(grid_t * grid_h * grid_w, channels * temporal * patch * patch))
