"""MLAConfig: the shape of DeepSeek's multi-head latent attention (from a HF config.json)."""

from __future__ import annotations

from dataclasses import dataclass

# transformers' DeepseekV2Config / DeepseekV3Config defaults, for keys a config.json leaves out.
_DEFAULTS = {
    "DeepseekV2ForCausalLM": dict(kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                                  qk_nope_head_dim=128, v_head_dim=128),
    "DeepseekV3ForCausalLM": dict(kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                                  qk_nope_head_dim=128, v_head_dim=128),
}

# How the rope half of q and k is rotated (all three rotate the same angles; they differ in which
# two values form a pair, the order they come out in, and where the rounding happens):
#   "complex": DeepSeek-V2 in transformers 5: pairs (x0, x1), (x2, x3), ... rotated as complex
#              numbers in fp32, written back interleaved, then cast to the model dtype;
#   "interleave": DeepSeek-V3 with rope_interleave (its default): the same pairs, rotated in the
#              model dtype and written back as [rotated evens | rotated odds];
#   "half": DeepSeek-V3 with rope_interleave false: rotate-half, as Llama.
ROPE_STYLES = ("complex", "interleave", "half")


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention: K and V are rebuilt per head from a `kv_lora_rank` latent.

    Per token and layer the KV pool holds the kv_a_layernorm-ed latent [kv_lora_rank] and the
    rotated rope key [qk_rope_head_dim], shared by every head. A head's query is
    [qk_nope_head_dim | qk_rope_head_dim] wide, its value `v_head_dim`.
    """

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None  # None: one q_proj; else q_a_proj -> q_a_layernorm -> q_b_proj
    rope_style: str = "interleave"  # one of ROPE_STYLES
    attention_bias: bool = False  # q_a_proj, kv_a_proj_with_mqa and o_proj have biases

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_dict(cls, raw: dict, architecture: str) -> MLAConfig | None:
        """None for architectures without MLA."""
        if architecture not in _DEFAULTS:
            return None
        values = {**_DEFAULTS[architecture], **{k: raw[k] for k in _DEFAULTS[architecture] if k in raw}}
        if architecture == "DeepseekV2ForCausalLM":
            rope_style = "complex"
        else:
            interleave = raw.get("rope_interleave")
            rope_style = "half" if interleave is not None and not interleave else "interleave"
        q_lora_rank = values.pop("q_lora_rank")
        config = cls(**{k: int(v) for k, v in values.items()},
                     q_lora_rank=int(q_lora_rank) if q_lora_rank else None,
                     rope_style=rope_style, attention_bias=bool(raw.get("attention_bias", False)))
        for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            if getattr(config, name) <= 0:
                raise ValueError(f"{architecture}: {name} must be positive, got {getattr(config, name)}")
        if config.qk_rope_head_dim % 2:
            raise ValueError(f"{architecture}: qk_rope_head_dim must be even, got {config.qk_rope_head_dim}")
        return config
