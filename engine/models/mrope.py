"""Qwen2-VL's multimodal rotary embedding (M-RoPE).

Each token has three positions (temporal, height, width). Text tokens have all three equal; an
image's tokens count its merged patch grid (t, h, w) from the position after the text before it,
and the text after an image continues from the image's largest position + 1, so a prompt's last
position is below its length: `rope_delta` (negative or 0) is what a generated token at sequence
index i adds to i (transformers' rope_deltas). The head's rotary frequencies are split into
sections (`mrope_section`, e.g. [16, 24, 24] of 64): section k rotates by position k.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.models.config import RopeConfig
from engine.models.rope import inverse_frequencies


def mrope_positions(prompt_ids: Sequence[int], grids: Sequence[tuple[int, int, int]], image_token_id: int,
                    merge_size: int) -> tuple[torch.Tensor, int]:
    """The prompt's positions [3, len(prompt_ids)] and its rope_delta, as transformers'
    Qwen2VLModel.get_rope_index. Image i's tokens must be one run of exactly its
    t * h * w / merge_size**2 `image_token_id`s; ValueError otherwise."""
    ids = torch.tensor(list(prompt_ids), dtype=torch.long)
    num = ids.shape[0]
    positions = torch.empty(3, num, dtype=torch.long)
    is_pad = (ids == image_token_id).tolist()
    next_pos, index, image = 0, 0, 0
    while index < num:
        if not is_pad[index]:
            run = index
            while run < num and not is_pad[run]:
                run += 1
            positions[:, index:run] = torch.arange(next_pos, next_pos + run - index)
            next_pos += run - index
            index = run
            continue
        if image >= len(grids):
            raise ValueError(f"prompt has more image-pad runs than the {len(grids)} images sent")
        t, h, w = grids[image]
        gh, gw = h // merge_size, w // merge_size
        count = t * gh * gw
        end = index + count
        if end > num or not all(is_pad[index:end]) or (end < num and is_pad[end]):
            raise ValueError(f"image {image} needs exactly {count} image-pad tokens in one run")
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij"))
        positions[:, index:end] = grid.reshape(3, count) + next_pos
        next_pos = int(positions[:, index:end].max()) + 1
        index, image = end, image + 1
    if image != len(grids):
        raise ValueError(f"{len(grids)} images sent but the prompt has image-pad runs for {image}")
    return positions, next_pos - num


class MRotary:
    """Per-token cos/sin [T, head_dim] for 3-D positions (fp32 math, cast to the model dtype, as
    transformers' Qwen2VLRotaryEmbedding + apply_multimodal_rotary_pos_emb)."""

    def __init__(self, rope: RopeConfig, head_dim: int, mrope_section: Sequence[int], dtype: torch.dtype,
                 device: torch.device, interleaved: bool = False) -> None:
        if sum(mrope_section) * 2 != head_dim:
            raise ValueError(f"mrope_section {list(mrope_section)} must sum to head_dim / 2 = "
                             f"{head_dim // 2}")
        self.inv_freq = inverse_frequencies(rope, head_dim).to(device)
        # which of the three positions rotates each frequency
        if interleaved:
            self.axis = interleaved_axes(mrope_section, head_dim // 2).to(device)
        else:
            self.axis = torch.repeat_interleave(torch.arange(3), torch.tensor(list(mrope_section))).to(device)
        self.attention_factor = rope.attention_factor
        self.dtype = dtype

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, T] -> cos, sin [T, head_dim]."""
        chosen = positions.index_select(0, self.axis)  # [head_dim / 2, T]
        freqs = chosen.t().to(torch.float32) * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return ((emb.cos() * self.attention_factor).to(self.dtype),
                (emb.sin() * self.attention_factor).to(self.dtype))


def interleaved_axes(mrope_section: Sequence[int], num_freqs: int) -> torch.Tensor:
    """Qwen3-VL's layout (transformers' Qwen3VLTextRotaryEmbedding.recomposition_frequencies):
    frequency j rotates by the height position when j % 3 == 1 and j < 3 * section[1], by the
    width when j % 3 == 2 and j < 3 * section[2], else by the temporal one."""
    axis = torch.zeros(num_freqs, dtype=torch.long)
    for dim in (1, 2):
        axis[dim:mrope_section[dim] * 3:3] = dim
    return axis
