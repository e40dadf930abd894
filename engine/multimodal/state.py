"""A multimodal request's engine-side state: its images, positions (M-RoPE's three rows, or one
row of plain positions for a model without M-RoPE, LLaVA), where its image tokens sit, and (once
the vision tower ran) their embeddings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.models.mrope import mrope_positions
from engine.multimodal.inputs import ImageInput
from pdserve.page_hash import image_page_salts


@dataclass(eq=False)
class MultimodalState:
    """Built once per request (`build`); kept across retraction (positions depend on the prompt only)."""

    images: tuple[ImageInput, ...]
    positions: torch.Tensor  # [3, num_prompt] under M-RoPE, else [1, num_prompt]
    rope_delta: int  # 0 without M-RoPE
    pad_positions: torch.Tensor  # [N] prompt indices of the image-pad tokens, in embedding-row order
    page_salts: list[int]  # per prompt page, the image digests it holds (0: none)
    # [N, hidden] (Qwen3-VL: [N, hidden * (1 + deepstack layers)]), filled at the first prefill chunk
    embeddings: torch.Tensor | None = field(default=None)

    @classmethod
    def build(cls, prompt_ids: Sequence[int], images: Sequence[ImageInput], image_token_id: int,
              merge_size: int, page_size: int, mrope: bool = True) -> MultimodalState:
        """ValueError when the prompt's image-pad tokens do not match the images' token counts."""
        pads = _pad_positions(prompt_ids, image_token_id)
        if mrope:
            positions, delta = mrope_positions(prompt_ids, [i.grid_thw for i in images], image_token_id,
                                               merge_size)
        else:
            # plain positions: the image tokens only need to be as many as the images take, in
            # order (as transformers' masked_scatter fills them)
            needed = sum(i.num_tokens(merge_size) for i in images)
            if needed != pads.numel():
                raise ValueError(f"{len(images)} images need {needed} image-pad tokens; the prompt has "
                                 f"{pads.numel()}")
            positions, delta = torch.arange(len(prompt_ids))[None], 0
        return cls(tuple(images), positions, delta, pads,
                   _salts(pads, images, merge_size, page_size, len(prompt_ids)))

    def position_rows(self, start: int, end: int) -> torch.Tensor:
        """Positions [3, end - start] of sequence indices start..end-1 (generated tokens past the
        prompt continue at index + rope_delta)."""
        num_prompt = self.positions.shape[1]
        if end <= num_prompt:
            return self.positions[:, start:end]
        tail = torch.arange(max(start, num_prompt), end) + self.rope_delta
        head = self.positions[:, start:num_prompt] if start < num_prompt else self.positions[:, :0]
        return torch.cat([head, tail.expand(head.shape[0], -1)], dim=1)

    def embedding_rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(offsets within the chunk start..end-1, embeddings) of the image tokens in it."""
        if self.embeddings is None:
            raise ValueError("embedding_rows of images whose embeddings are not computed yet")
        mask = (self.pad_positions >= start) & (self.pad_positions < end)
        return self.pad_positions[mask] - start, self.embeddings[mask]


def page_salts(prompt_ids: Sequence[int], images: Sequence[ImageInput], image_token_id: int,
               merge_size: int, page_size: int) -> list[int]:
    """The salts `build` gives the prompt's pages, without the positions: what a PD decode worker
    hashes a prompt with before its prefix-cache lookup, so its page hashes equal the prefill's."""
    pads = _pad_positions(prompt_ids, image_token_id)
    if len(pads) != sum(i.num_tokens(merge_size) for i in images):
        raise ValueError(f"prompt has {len(pads)} image-pad tokens; its {len(images)} images take "
                         f"{sum(i.num_tokens(merge_size) for i in images)}")
    return _salts(pads, images, merge_size, page_size, len(prompt_ids))


def _pad_positions(prompt_ids: Sequence[int], image_token_id: int) -> torch.Tensor:
    return (torch.tensor(list(prompt_ids), dtype=torch.long) == image_token_id).nonzero().flatten()


def _salts(pads: torch.Tensor, images: Sequence[ImageInput], merge_size: int, page_size: int,
           num_tokens: int) -> list[int]:
    spans, start = [], 0
    for image in images:
        count = image.num_tokens(merge_size)
        spans.append((int(pads[start]), int(pads[start + count - 1]) + 1, image.digest))
        start += count
    return image_page_salts(spans, page_size, num_tokens)


def text_positions(start: int, end: int, rows: int = 3) -> torch.Tensor:
    """Positions [rows, end - start] of a text-only sequence (M-RoPE's three axes equal: plain RoPE)."""
    return torch.arange(start, end).expand(rows, -1)
