"""Random decoder configs within what transformers accepts, one drawer per supported text architecture.

Each draw is a transformers config object (built by the architecture's own config class, so what
it refuses is never drawn) over the switches that change the math: head counts and GQA ratios,
head_dim other than hidden / heads, tied or untied embeddings, rope variants and theta, biases, norm
eps, and for mixtures of experts the expert counts, top-k, renormalisation, dense layers and the
grouped routing of DeepSeek. Shapes stay tiny (hidden <= 128, at most 3 layers) so a draw's
checkpoint is built, saved and compared in about a second.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from tools.models.saved_checkpoint import VOCAB_SIZE


def _attention(rng: random.Random, head_dim_free: bool = True) -> dict[str, Any]:
    heads = rng.choice([2, 4, 6, 8])
    kv = rng.choice([k for k in (1, 2, 3, 4, 6, 8) if heads % k == 0])
    # transformers refuses a hidden size that is not a multiple of the heads, even with head_dim set
    hidden = heads * rng.choice([w for w in (8, 12, 16, 24, 32) if heads * w <= 192])
    fields: dict[str, Any] = dict(num_attention_heads=heads, num_key_value_heads=kv, hidden_size=hidden)
    if head_dim_free and rng.random() < 0.6:
        fields["head_dim"] = rng.choice([8, 16, 24, 32, 48])
    return fields


def _rope(rng: random.Random, max_positions: int) -> dict[str, Any]:
    theta = rng.choice([10_000.0, 500_000.0, 1_000_000.0])
    kind = rng.choice(["default", "default", "linear", "llama3"])
    params: dict[str, Any] = {"rope_type": kind, "rope_theta": theta}
    if kind == "linear":
        params["factor"] = rng.choice([2.0, 4.0])
    elif kind == "llama3":
        params.update(factor=rng.choice([4.0, 8.0]), low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=max_positions // 4)
    return {"rope_parameters": params, "max_position_embeddings": max_positions}


def _common(rng: random.Random) -> dict[str, Any]:
    return dict(vocab_size=VOCAB_SIZE, num_hidden_layers=rng.randint(1, 3),
                intermediate_size=rng.choice([64, 96, 160, 256]), tie_word_embeddings=rng.random() < 0.5,
                rms_norm_eps=rng.choice([1e-6, 1e-5]), bos_token_id=None, eos_token_id=None,
                pad_token_id=None,
                **_rope(rng, rng.choice([1024, 4096])))


def llama(rng: random.Random) -> dict[str, Any]:
    return dict(**_common(rng), **_attention(rng), attention_bias=rng.random() < 0.4,
                mlp_bias=rng.random() < 0.4)


def qwen2(rng: random.Random) -> dict[str, Any]:
    return dict(**_common(rng), **_attention(rng, head_dim_free=False))


def qwen3(rng: random.Random) -> dict[str, Any]:
    return dict(**_common(rng), **_attention(rng), attention_bias=rng.random() < 0.4)


def qwen3_moe(rng: random.Random) -> dict[str, Any]:
    fields = qwen3(rng)
    experts = rng.randint(2, 8)
    layers = fields["num_hidden_layers"]
    return dict(**fields, num_experts=experts, num_experts_per_tok=rng.randint(1, experts),
                moe_intermediate_size=rng.choice([32, 64, 96]), norm_topk_prob=rng.random() < 0.5,
                decoder_sparse_step=rng.choice([1, 1, 2]),
                mlp_only_layers=sorted(rng.sample(range(layers), rng.randint(0, layers - 1))))


def mixtral(rng: random.Random) -> dict[str, Any]:
    experts = rng.randint(2, 8)
    return dict(**_common(rng), **_attention(rng), num_local_experts=experts,
                num_experts_per_tok=rng.randint(1, experts), sliding_window=None)


def _deepseek(rng: random.Random, v3: bool) -> dict[str, Any]:
    fields = _common(rng)
    theta = fields["rope_parameters"]["rope_theta"]
    fields["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}  # (yarn: the presets' tests)
    heads = rng.choice([2, 4])
    groups = rng.choice([1, 2, 4])
    experts = groups * rng.choice([2, 3]) if v3 else groups * rng.choice([1, 2, 3])
    method = "noaux_tc" if v3 else rng.choice(["greedy", "group_limited_greedy"])
    topk_group = rng.randint(1, groups)
    per_group = experts // groups
    top_k = rng.randint(1, topk_group * per_group if method != "greedy" else experts)
    deepseek: dict[str, Any] = dict(
        hidden_size=rng.choice([64, 128]), num_attention_heads=heads, num_key_value_heads=heads,
        kv_lora_rank=rng.choice([16, 32]), q_lora_rank=rng.choice([None, 24, 48]),
        qk_rope_head_dim=rng.choice([8, 16]), qk_nope_head_dim=rng.choice([8, 16, 24]),
        v_head_dim=rng.choice([8, 16, 32]), n_routed_experts=experts, num_experts_per_tok=top_k,
        n_group=groups, topk_group=topk_group, topk_method=method, n_shared_experts=rng.choice([1, 2]),
        moe_intermediate_size=rng.choice([32, 64]),
        first_k_dense_replace=rng.randint(0, fields["num_hidden_layers"] - 1),
        routed_scaling_factor=rng.choice([1.0, 2.5]), norm_topk_prob=rng.random() < 0.5,
        attention_bias=rng.random() < 0.3)
    if v3:
        deepseek["rope_interleave"] = rng.random() < 0.5
    return {**fields, **deepseek}


def deepseek_v2(rng: random.Random) -> dict[str, Any]:
    return _deepseek(rng, v3=False)


def deepseek_v3(rng: random.Random) -> dict[str, Any]:
    return _deepseek(rng, v3=True)


# architecture -> (transformers config class name, drawer)
DRAWERS: dict[str, tuple[str, Callable[[random.Random], dict[str, Any]]]] = {
    "LlamaForCausalLM": ("LlamaConfig", llama),
    "Qwen2ForCausalLM": ("Qwen2Config", qwen2),
    "Qwen3ForCausalLM": ("Qwen3Config", qwen3),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", qwen3_moe),
    "MixtralForCausalLM": ("MixtralConfig", mixtral),
    "DeepseekV2ForCausalLM": ("DeepseekV2Config", deepseek_v2),
    "DeepseekV3ForCausalLM": ("DeepseekV3Config", deepseek_v3),
}


def draw(architecture: str, rng: random.Random, attempts: int = 20) -> Any:
    """A transformers config object of `architecture`, fields drawn from `rng`; a draw the config
    class refuses (its validators) is drawn again."""
    import transformers

    class_name, drawer = DRAWERS[architecture]
    refusal: Exception | None = None
    for _ in range(attempts):
        try:
            return getattr(transformers, class_name)(**drawer(rng), architectures=[architecture])
        except Exception as exc:  # transformers' validators raise their own error classes
            refusal = exc
    raise AssertionError(f"{attempts} draws of {architecture} refused by transformers; last: {refusal}")
