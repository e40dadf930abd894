"""The `tiny-llava` preset: a random-weight LLaVA checkpoint (LlavaForConditionalGeneration) in
transformers' layout, offline.

A CLIP vision tower of width 64 (2 layers, 56-pixel images in 14-pixel patches: 16 patches), a
projector (linear, GELU, linear) to a small Llama decoder (hidden 128, 2 layers, plain RoPE) with
LLaVA-1.5's feature choice (the second to last layer's hidden states, CLS dropped): every image
is 16 image tokens. The tokenizer is the built-in one trained to 4095 tokens plus `<image>` at
4095, and a LLaVA-1.5-style template ("USER: <image>\\n... ASSISTANT:") rendering each image part
as `<image>` (the server expands it to the image's 16 tokens: engine.multimodal.prompt).
preprocessor_config.json is CLIPImageProcessor's: shorter side to 56, center crop 56x56.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tools.models.tiny_vl import (
    VOCAB_SIZE,
    _write_json,
    write_generation_config,
    write_random_weights,
    write_vl_tokenizer,
)
from tools.models.tokenizer_train import ENDOFTEXT, IM_END, special_token_ids

IMAGE = "<image>"
IMAGE_TOKEN_ID = VOCAB_SIZE - 1
IMAGE_SIZE, PATCH_SIZE = 56, 14
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2

LLAVA_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- message['role'] | upper + ': ' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] in ('image', 'image_url') %}{{- '<image>\\n' }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{%- if message['role'] == 'assistant' %}{{- '<|im_end|>' }}{%- endif %}"
    "{{- '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'ASSISTANT:' }}{%- endif %}"
)

PREPROCESSOR = {
    "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}, "do_center_crop": True, "do_convert_rgb": True,
    "do_normalize": True, "do_rescale": True, "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor", "resample": 3,
    "rescale_factor": 1 / 255, "size": {"shortest_edge": IMAGE_SIZE},
}


def llava_config() -> dict[str, Any]:
    """config.json contents (transformers 5's nested layout)."""
    from transformers import LlavaConfig

    ids = special_token_ids()
    config = LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, image_size=IMAGE_SIZE,
                           patch_size=PATCH_SIZE, projection_dim=64),
        text_config=dict(model_type="llama", vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=4096, rms_norm_eps=1e-6, initializer_range=0.3,
                         bos_token_id=ids[ENDOFTEXT], eos_token_id=ids[IM_END], tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        image_token_index=IMAGE_TOKEN_ID, projector_hidden_act="gelu",
        vision_feature_select_strategy="default", vision_feature_layer=-2, image_seq_length=IMAGE_TOKENS,
        tie_word_embeddings=True)  # an untied head would be 2 MB more
    raw = config.to_dict()
    raw["architectures"] = ["LlavaForConditionalGeneration"]
    raw["torch_dtype"] = "float32"
    return raw


def write_tiny_llava(out: Path, seed: int, corpus_bytes: int, std: float = 0.3) -> Path:
    """Write the checkpoint folder; deterministic for a seed."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    write_vl_tokenizer(out, {IMAGE: IMAGE_TOKEN_ID}, corpus_bytes, seed)
    (out / "chat_template.jinja").write_text(LLAVA_CHAT_TEMPLATE)
    config = llava_config()
    _write_json(out / "config.json", config)
    write_generation_config(out)
    _write_json(out / "preprocessor_config.json", PREPROCESSOR)
    # CLIP's LayerNorm weights start at one, as transformers initializes them
    write_random_weights(out, LlavaForConditionalGeneration, LlavaConfig.from_dict(config), std, seed,
                         ones=("layer_norm1.weight", "layer_norm2.weight", "pre_layrnorm.weight"))
    return out
