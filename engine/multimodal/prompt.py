"""Prompt ids for images: each image's one image-pad token (as a chat template renders it)
becomes one per token the vision tower gives it, as transformers' Qwen2VLProcessor expands them."""

from __future__ import annotations

from collections.abc import Sequence

from engine.multimodal.inputs import ImageInput


def expand_image_tokens(prompt_ids: Sequence[int], images: Sequence[ImageInput], image_token_id: int,
                        merge_size: int) -> list[int]:
    """`prompt_ids` with its i-th image-pad token repeated images[i].num_tokens times; ValueError
    when the prompt's image-pad count differs from the number of images."""
    found = sum(1 for t in prompt_ids if t == image_token_id)
    if found != len(images):
        raise ValueError(f"prompt has {found} image placeholders but {len(images)} images were sent")
    out: list[int] = []
    index = 0
    for token in prompt_ids:
        if token == image_token_id:
            out.extend([image_token_id] * images[index].num_tokens(merge_size))
            index += 1
        else:
            out.append(token)
    return out
