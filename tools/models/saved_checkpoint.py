"""Random-weight checkpoints written by transformers' own `save_pretrained`, from any config.

The presets (tools.models.tiny_model) write config.json and the tensors by hand, in one layout per
family; a user's checkpoint is written by transformers, whose config.json spells fields its own
way (`num_local_experts`, `rope_parameters`, `dtype`, nested text/vision configs) and leaves
defaults out. This writes such a folder: the model class built from a transformers config object,
every weight redrawn from a seed (uniform, standard deviation `std`: see tiny_model's note on why
0.3), saved with save_pretrained, plus the built-in tokenizer (with Qwen2-VL's vision tokens at the
top of its 4096 ids) and, for a vision model, the image processor's own save_pretrained.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import torch

from tools.models.tiny_vl import (
    VISION_TOKEN_IDS,
    VL_CHAT_TEMPLATE,
    write_generation_config,
    write_vl_tokenizer,
)

VOCAB_SIZE = 4096  # the built-in tokenizer's; token ids 4093.. are the vision tokens


def write_tokenizer_files(out: Path, seed: int = 0, corpus_bytes: int = 300_000) -> Path:
    """The built-in tokenizer with the vision tokens, the VL-aware ChatML template and
    generation_config.json: what every checkpoint written here shares (copy it with `copy_tokenizer`)."""
    out.mkdir(parents=True, exist_ok=True)
    write_vl_tokenizer(out, VISION_TOKEN_IDS, corpus_bytes, seed)
    (out / "chat_template.jinja").write_text(VL_CHAT_TEMPLATE)
    write_generation_config(out)
    return out


def copy_tokenizer(source: Path, out: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(source / name, out / name)


def model_class(config: Any) -> type:
    import transformers

    return getattr(transformers, config.architectures[0])


def save_random_checkpoint(out: Path, config: Any, seed: int, tokenizer_dir: Path, std: float = 0.3,
                           image_processor: Any = None) -> Path:
    """`config` (a transformers config object whose `architectures` names the model class) as a
    checkpoint folder at `out`, weights drawn from `seed`."""
    out.mkdir(parents=True, exist_ok=True)
    model = model_class(config)(config).to(torch.float32)
    randomize(model, seed, std)
    model.save_pretrained(str(out))
    copy_tokenizer(tokenizer_dir, out)
    if image_processor is not None:
        image_processor.save_pretrained(str(out))
    return out


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int, std: float) -> None:
    """Every floating parameter and persistent buffer the checkpoint holds redrawn uniform with
    standard deviation `std` (in name order, from one generator), but norm weights, which stay at
    transformers' init (ones) and DeepSeek's router correction bias, drawn small and positive (it
    is zero at init, which would leave grouped routing untested)."""
    generator = torch.Generator().manual_seed(seed)
    half_width = std * math.sqrt(3.0)
    tensors = dict(model.named_parameters())
    tensors.update((n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    for name in sorted(tensors):
        tensor = tensors[name]
        if not tensor.is_floating_point() or ("norm" in name and name.endswith("weight")):
            continue
        uniform = torch.rand(tensor.shape, generator=generator, dtype=torch.float32)
        if name.endswith("e_score_correction_bias"):
            tensor.copy_(uniform * 0.1)
        else:
            tensor.copy_((uniform * 2.0 - 1.0) * half_width)
