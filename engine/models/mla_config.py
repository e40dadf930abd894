"""MLAConfig: the shape of DeepSeek's multi-head latent attention (from a HF config.json)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention: K and V are rebuilt per head from a `kv_lora_rank` latent."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None

    @classmethod
    def from_dict(cls, raw: dict, architecture: str) -> MLAConfig | None:
        """None for architectures without MLA."""
        return None
