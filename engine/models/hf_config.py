"""config.json as transformers reads it: every field through the architecture's own config class.

A checkpoint's config.json holds only what its writer chose to write; transformers fills the rest
from its config class's defaults and rules (`__post_init__`), and answers a field under each of its
names (`attribute_map`: Qwen3-MoE's `num_experts` is stored as `num_local_experts`, DeepSeek's
`num_local_experts` as `n_routed_experts`). Reading the raw JSON by hand, with defaults of our own,
turned an unusual but valid checkpoint into a crash or a silently different model; so
`resolve_config` runs the JSON through the class transformers would use and hands ModelConfig the
resolved fields, under every name, with the class's defaults in place of the missing ones.

Fields transformers understands but the engine does not implement are refused here, by name
(`refuse_unsupported`), instead of being ignored.
"""

from __future__ import annotations

from typing import Any

# model_type of a config.json without one, from its architecture (old checkpoints)
_ARCH_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                     "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral",
                     "DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3",
                     "Qwen2VLForConditionalGeneration": "qwen2_vl",
                     "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
                     "Qwen3VLForConditionalGeneration": "qwen3_vl", "LlavaForConditionalGeneration": "llava"}


def resolve_config(raw: dict) -> dict:
    """`raw` (a config.json) as transformers' config class for its model_type resolves it: every
    attribute with the class's default where the file has none, each `attribute_map` alias beside
    the field it names, and the same for the nested text_config and vision_config. A model_type
    transformers does not know is returned unchanged (ModelConfig refuses it by name)."""
    from transformers import CONFIG_MAPPING  # imported here: transformers is slow to import

    model_type = raw.get("model_type") or next(
        (_ARCH_MODEL_TYPES[a] for a in raw.get("architectures") or [] if a in _ARCH_MODEL_TYPES), None)
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        return raw
    config = CONFIG_MAPPING[model_type].from_dict({**raw, "model_type": model_type})
    resolved = _attributes(config)
    for name in ("text_config", "vision_config"):
        sub = getattr(config, name, None)
        if sub is not None and not isinstance(sub, dict):
            resolved[name] = _attributes(sub)
    # transformers 5 names the dtype `dtype`; keep the file's spelling readable under both
    if resolved.get("dtype") is not None and not isinstance(resolved["dtype"], str):
        resolved["dtype"] = str(resolved["dtype"]).removeprefix("torch.")
    resolved.setdefault("torch_dtype", resolved.get("dtype"))
    return resolved


def _attributes(config: Any) -> dict:
    values = config.to_dict()
    for alias in getattr(config, "attribute_map", {}) or {}:
        values[alias] = getattr(config, alias)
    return values


def refuse_unsupported(text: dict, architecture: str) -> None:
    """ValueError naming a resolved decoder field whose value the engine does not implement."""
    layer_types = text.get("layer_types") or ()
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise ValueError(f"unsupported layer_types {other} for {architecture}: only full_attention is "
                         "implemented (no sliding-window layers)")
    if architecture == "MixtralForCausalLM" and text.get("sliding_window") is not None:
        raise ValueError(f"unsupported sliding_window {text['sliding_window']!r} for {architecture}: "
                         "sliding-window attention is not implemented (set it to null)")
