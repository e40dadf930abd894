"""What a multimodal request carries into the engine: its images, already preprocessed."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ImageInput:
    """One image: `pixel_values` [grid_t * grid_h * grid_w, C * T * P * P] (fp32), `grid_thw` its
    patch grid, and `digest` a 64-bit hash of both (what the prefix cache keys its pages by:
    pdserve.page_hash.image_page_salts)."""

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    digest: int

    @classmethod
    def from_pixels(cls, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> ImageInput:
        pixel_values = pixel_values.to(torch.float32).contiguous()
        grid_thw = (int(grid_thw[0]), int(grid_thw[1]), int(grid_thw[2]))
        if pixel_values.dim() != 2 or pixel_values.shape[0] != grid_thw[0] * grid_thw[1] * grid_thw[2]:
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)} do not match grid_thw {grid_thw}")
        hasher = hashlib.blake2b(digest_size=8)
        hasher.update(repr(grid_thw).encode())
        hasher.update(pixel_values.numpy().tobytes())
        return cls(pixel_values, grid_thw, int.from_bytes(hasher.digest(), "little"))

    def num_tokens(self, merge_size: int) -> int:
        """The image-pad tokens it takes in the prompt (one per merge x merge window of patches)."""
        t, h, w = self.grid_thw
        return t * h * w // (merge_size * merge_size)
