"""The `tiny-vl`, `tiny-qwen25-vl` and `tiny-qwen3-vl` presets: random-weight Qwen2-VL,
Qwen2.5-VL and Qwen3-VL checkpoints in transformers' layout, offline.

The decoder is a small Qwen2 (hidden 128, 2 layers, M-RoPE sections [4, 6, 6] of head_dim 32),
the vision tower a 2-block ViT of width 64 with patch 14 and 2x2 merging. The tokenizer is the
built-in one (tools.models.tokenizer_train) trained to 4093 tokens, plus Qwen2-VL's three vision
tokens at ids 4093.. (`VISION_TOKENS`), and a ChatML template that renders an image content
part as <|vision_start|><|image_pad|><|vision_end|> (the server expands the pad to the image's
token count: engine.multimodal.prompt). preprocessor_config.json keeps images small
(max_pixels 28*28*64) so tests run fast on CPU. Qwen2.5-VL's tower has the same width with
RMSNorm and gated MLPs, window attention in block 0 (windows of 56 pixels: 2x2 image tokens,
so a 112-pixel image has four) and full attention in block 1 (fullatt_block_indexes). Qwen3-VL's
decoder is a Qwen3 (q/k norms) with interleaved M-RoPE, its tower takes 16-pixel patches and adds
block 0's deepstack feature to the image tokens after decoder layer 0; its processor has mean/std
0.5 and max_pixels 32*32*64.
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


# preset family -> (transformers config class, model class, architecture) names
FAMILIES = {
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
}
_VISION = {
    "qwen2_vl": dict(depth=2, embed_dim=64, hidden_size=128, num_heads=4, mlp_ratio=2, patch_size=14,
                     spatial_merge_size=2, temporal_patch_size=2, in_chans=3),
    "qwen2_5_vl": dict(depth=2, hidden_size=64, intermediate_size=128, out_hidden_size=128, num_heads=4,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                       window_size=56, fullatt_block_indexes=[1], hidden_act="silu"),
    # 16-pixel patches, learned position embeddings on an 8x8 grid (interpolated to each image's),
    # block 0's deepstack feature added after decoder layer 0
    "qwen3_vl": dict(depth=2, hidden_size=64, intermediate_size=128, out_hidden_size=128, num_heads=4,
                     patch_size=16, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                     num_position_embeddings=64, deepstack_visual_indexes=[0]),
}
# Qwen3-VL's processor: 16-pixel patches (32-pixel image tokens), mean/std 0.5
PREPROCESSOR_QWEN3 = {
    "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "image_processor_type": "Qwen2VLImageProcessor",
    "merge_size": 2, "min_pixels": 64 * 64, "max_pixels": 32 * 32 * 64, "patch_size": 16,
    "processor_class": "Qwen3VLProcessor", "resample": 3, "rescale_factor": 1 / 255,
    "size": {"shortest_edge": 64 * 64, "longest_edge": 32 * 32 * 64}, "temporal_patch_size": 2,
}


def _classes(family: str) -> tuple[type, type]:
    import transformers

    config_name, model_name = FAMILIES[family]
    return getattr(transformers, config_name), getattr(transformers, model_name)


def vl_config(family: str = "qwen2_vl") -> dict[str, Any]:
    """config.json contents (transformers 5's nested layout)."""
    config_class, _ = _classes(family)
    ids = special_token_ids()
    rope = {"rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6], "rope_theta": 1_000_000.0}}
    if family == "qwen3_vl":  # Qwen3's head_dim is its own field (default 128)
        rope = {"head_dim": 32, "rope_parameters": {"rope_type": "default", "mrope_section": [4, 6, 6],
                                                    "mrope_interleaved": True, "rope_theta": 1_000_000.0}}
    config = config_class(
        text_config=dict(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         rms_norm_eps=1e-6, initializer_range=0.3, bos_token_id=ids[ENDOFTEXT],
                         eos_token_id=ids[IM_END], **rope),
        vision_config=_VISION[family],
        image_token_id=VISION_TOKEN_IDS[IMAGE_PAD], video_token_id=VISION_TOKEN_IDS[IMAGE_PAD],
        vision_start_token_id=VISION_TOKEN_IDS[VISION_START],
        vision_end_token_id=VISION_TOKEN_IDS[VISION_END],
        tie_word_embeddings=True)  # an untied head would be 2 MB more
    raw = config.to_dict()
    raw["architectures"] = [FAMILIES[family][1]]
    raw["torch_dtype"] = "float32"
    return raw


def write_tiny_vl(out: Path, seed: int, corpus_bytes: int, std: float = 0.3,
                  family: str = "qwen2_vl") -> Path:
    """Write the checkpoint folder; deterministic for a seed."""
    out.mkdir(parents=True, exist_ok=True)
    write_vl_tokenizer(out, VISION_TOKEN_IDS, corpus_bytes, seed)
    (out / "chat_template.jinja").write_text(VL_CHAT_TEMPLATE)
    config = vl_config(family)
    _write_json(out / "config.json", config)
    write_generation_config(out)
    _write_json(out / "preprocessor_config.json",
                PREPROCESSOR_QWEN3 if family == "qwen3_vl" else PREPROCESSOR)
    config_class, model_class = _classes(family)
    # The vision tower's norm weights ("norm1.weight", "ln_q.weight") start at one, as transformers
    # initializes them; iter_random_weights does so for names ending "norm.weight".
    write_random_weights(out, model_class, config_class.from_dict(config), std, seed,
                         ones=("norm1.weight", "norm2.weight", "ln_q.weight"))
    return out


def write_vl_tokenizer(out: Path, tokens: dict[str, int], corpus_bytes: int, seed: int) -> None:
    """The built-in tokenizer trained to VOCAB_SIZE - len(tokens), plus `tokens` (special, never
    split) at their ids, the last of the vocabulary."""
    write_tokenizer(out, vocab_size=VOCAB_SIZE - len(tokens), corpus_bytes=corpus_bytes, seed=seed)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    ordered = sorted(tokens, key=tokens.get)  # type: ignore[arg-type]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ordered])
    tokenizer.save(str(out / "tokenizer.json"), pretty=False)
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    for token, index in tokens.items():
        tok_config["added_tokens_decoder"][str(index)] = {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True}
    _write_json(out / "tokenizer_config.json", tok_config)


def write_generation_config(out: Path) -> None:
    ids = special_token_ids()
    _write_json(out / "generation_config.json", {"bos_token_id": ids[ENDOFTEXT], "do_sample": False,
                                                 "eos_token_id": [ids[IM_END], ids[ENDOFTEXT]],
                                                 "pad_token_id": ids[ENDOFTEXT]})


def write_random_weights(out: Path, model_class: type, config: Any, std: float, seed: int,
                         ones: tuple[str, ...]) -> None:
    """model.safetensors: every parameter of `model_class(config)` drawn from `seed` (the tied LM
    head left out), those whose names end with one of `ones` set to one (norm weights)."""
    from safetensors.torch import save_file

    from tools.models.tiny_model import iter_random_weights

    with torch.device("meta"):
        model = model_class(config)
    shapes = {name: (tuple(p.shape), p.dtype) for name, p in model.named_parameters(remove_duplicate=True)}
    shapes.pop("lm_head.weight", None)  # tied to the embeddings
    weights = {}
    for name, tensor in iter_random_weights(shapes, std, seed):
        weights[name] = torch.ones_like(tensor) if name.endswith(ones) else tensor
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
