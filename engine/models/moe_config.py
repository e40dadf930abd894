"""MoEConfig: which layers route tokens to experts, and how (from a HF config.json)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts of a mixture-of-experts checkpoint."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    sparse_layers: tuple[int, ...]  # layer indices whose MLP is routed; the others are dense

    @classmethod
    def from_dict(cls, raw: dict, architecture: str) -> MoEConfig | None:
        """None for dense architectures."""
        return None
