"""Routed experts: a layer's MLP as a router plus expert SwiGLU MLPs (and shared experts)."""

from __future__ import annotations

import torch

from engine.models.weights import ShardedReader


class MoEBlock:
    """One layer's mixture-of-experts MLP; __call__ returns this rank's partial output [T, hidden]."""

    @classmethod
    def load(cls, weights: ShardedReader, layer_prefix: str, config) -> MoEBlock:
        raise NotImplementedError("routed experts are not implemented yet")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError
