"""A multimodal request's engine-side state: its images, M-RoPE positions, where its image
tokens sit, and (once the vision tower ran) their embeddings."""

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
    positions: torch.Tensor  # [3, num_prompt]
    rope_delta: int
    pad_positions: torch.Tensor  # [N] prompt indices of the image-pad tokens, in embedding-row order
    page_salts: list[int]  # per prompt page, the image digests it holds (0: none)
    embeddings: torch.Tensor | None = field(default=None)  # [N, hidden], filled at the first prefill chunk

    @classmethod
    def build(cls, prompt_ids: Sequence[int], images: Sequence[ImageInput], image_token_id: int,
              merge_size: int, page_size: int) -> MultimodalState:
        positions, delta = mrope_positions(prompt_ids, [i.grid_thw for i in images], image_token_id, merge_size)
        pads = _pad_positions(prompt_ids, image_token_id)
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
        return torch.cat([head, tail.expand(3, -1)], dim=1)

    def embedding_rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(offsets within the chunk start..end-1, embeddings) of the image tokens in it."""
        mask = (self.pad_positions >= start) & (self.pad_positions < end)
        return self.pad_positions[mask] - start, self.embeddings[mask]  # type: ignore[index]


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


def text_positions(start: int, end: int) -> torch.Tensor:
    """Positions [3, end - start] of a text-only sequence (all three axes equal: plain RoPE)."""
    return torch.arange(start, end).expand(3, -1)
