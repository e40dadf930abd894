"""The `tiny-vl` preset: a random-weight Qwen2-VL checkpoint in transformers' layout, offline.

The decoder is a small Qwen2 (hidden 128, 2 layers, M-RoPE sections [4, 6, 6] of head_dim 32),
the vision tower a 2-block ViT of width 64 with patch 14 and 2x2 merging. The tokenizer is the
built-in one (tools.models.tokenizer_train) trained to 4093 tokens, plus Qwen2-VL's three vision
tokens at ids 4093.. (`VISION_TOKENS`), and a ChatML template that renders an image content
part as <|vision_start|><|image_pad|><|vision_end|> (the server expands the pad to the image's
token count: engine.multimodal.prompt). preprocessor_config.json keeps images small
(max_pixels 28*28*64) so tests run fast on CPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer

from tools.models.tokenizer_train import ENDOFTEXT, IM_END, special_token_ids, write_tokenizer

VOCAB_SIZE = 4096
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD)
VISION_TOKEN_IDS = {tok: VOCAB_SIZE - len(VISION_TOKENS) + i for i, tok in enumerate(VISION_TOKENS)}

# ChatML whose message content is a string or a list of parts ({"type": "text"} / {"type": "image"}
# or "image_url"), as Qwen2-VL's own template renders them.
VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] in ('image', 'image_url') %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

PREPROCESSOR = {
    "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor", "merge_size": 2, "min_pixels": 56 * 56,
    "max_pixels": 28 * 28 * 64, "patch_size": 14, "processor_class": "Qwen2VLProcessor",
    "resample": 3, "rescale_factor": 1 / 255, "temporal_patch_size": 2,
}


def vl_config() -> dict[str, Any]:
    """config.json contents (transformers 5's nested layout)."""
    from transformers import Qwen2VLConfig

    ids = special_token_ids()
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         rms_norm_eps=1e-6, initializer_range=0.3, bos_token_id=ids[ENDOFTEXT],
                         eos_token_id=ids[IM_END],
                         rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6], "rope_theta": 1_000_000.0}),
        vision_config=dict(depth=2, embed_dim=64, hidden_size=128, num_heads=4, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_chans=3),
        image_token_id=VISION_TOKEN_IDS[IMAGE_PAD], video_token_id=VISION_TOKEN_IDS[IMAGE_PAD],
        vision_start_token_id=VISION_TOKEN_IDS[VISION_START], vision_end_token_id=VISION_TOKEN_IDS[VISION_END],
        tie_word_embeddings=True)  # an untied head would be 2 MB more
    raw = config.to_dict()
    raw["architectures"] = ["Qwen2VLForConditionalGeneration"]
    raw["torch_dtype"] = "float32"
    return raw


def write_tiny_vl(out: Path, seed: int, corpus_bytes: int, std: float = 0.3) -> Path:
    """Write the checkpoint folder; deterministic for a seed."""
    from safetensors.torch import save_file
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from tools.models.tiny_model import iter_random_weights

    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out, vocab_size=VOCAB_SIZE - len(VISION_TOKENS), corpus_bytes=corpus_bytes, seed=seed)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    tokenizer.save(str(out / "tokenizer.json"), pretty=False)
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    for token, index in VISION_TOKEN_IDS.items():
        tok_config["added_tokens_decoder"][str(index)] = {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True}
    _write_json(out / "tokenizer_config.json", tok_config)
    (out / "chat_template.jinja").write_text(VL_CHAT_TEMPLATE)
    config = vl_config()
    _write_json(out / "config.json", config)
    ids = special_token_ids()
    _write_json(out / "generation_config.json", {"bos_token_id": ids[ENDOFTEXT], "do_sample": False,
                                                 "eos_token_id": [ids[IM_END], ids[ENDOFTEXT]],
                                                 "pad_token_id": ids[ENDOFTEXT]})
    _write_json(out / "preprocessor_config.json", PREPROCESSOR)
    with torch.device("meta"):
        model = Qwen2VLForConditionalGeneration(Qwen2VLConfig.from_dict(config))
    shapes = {name: (tuple(p.shape), p.dtype) for name, p in model.named_parameters(remove_duplicate=True)}
    shapes.pop("lm_head.weight", None)  # tied to the embeddings
    # The vision tower's LayerNorm weights ("norm1.weight", "ln_q.weight") start at one, as
    # transformers initializes them; iter_random_weights does so for names ending "norm.weight".
    weights = {}
    for name, tensor in iter_random_weights(shapes, std, seed):
        if name.endswith(("norm1.weight", "norm2.weight", "ln_q.weight")):
            tensor = torch.ones_like(tensor)
        weights[name] = tensor
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    return out


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
