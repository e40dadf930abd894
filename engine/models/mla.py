"""Multi-head latent attention (DeepSeek V2/V3) over a KV pool that stores the compressed latent."""

from __future__ import annotations

import torch

from engine.models.attention import AttentionMetadata
from engine.models.weights import ShardedReader


class MLAAttention:
    """One layer's MLA; __call__ stores this step's latent rows and returns this rank's partial
    o_proj output [T, hidden]."""

    @classmethod
    def load(cls, weights: ShardedReader, attn_prefix: str, config) -> MLAAttention:
        raise NotImplementedError("multi-head latent attention is not implemented yet")

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, max_position: int, buffer: torch.Tensor,
                 layer: int, meta: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError
