"""A projection's LoRA slot pool with random adapters, for the batched product's kernel tests."""

from __future__ import annotations

import torch


def random_pool(slots: int, rank: int, bounds: tuple[int, ...], in_features: int, ranks: list[int],
                seed: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """A projection's slot pool as engine.lora.slots fills it: each fused sub-module m with its own
    `rank` rows of A and Bt (only slot s's first ranks[s] of them set) and Bt only on m's columns."""
    generator = torch.Generator().manual_seed(seed)
    modules, width = len(bounds) - 1, (len(bounds) - 1) * rank
    a = torch.zeros(slots * width, in_features)
    bt = torch.zeros(slots * width, bounds[-1])
    for slot, used in enumerate(ranks):
        for m in range(modules):
            first = slot * width + m * rank
            a[first:first + used] = torch.randn(used, in_features, generator=generator) * 0.3
            bt[first:first + used, bounds[m]:bounds[m + 1]] = torch.randn(
                used, bounds[m + 1] - bounds[m], generator=generator) * 0.3
    return a.to(dtype), bt.to(dtype)
