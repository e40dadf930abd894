"""TPShard: which slice of each weight and of the KV heads one tensor-parallel rank owns.

The usual Megatron split for Llama/Qwen: q/k/v and gate/up are column-parallel (each rank computes
its heads and its MLP columns), o_proj and down are row-parallel (each rank multiplies its slice of
the input; the partial outputs are summed by an all-reduce). Embeddings, norms and the LM head are
replicated, so every rank holds the full residual stream and the same logits; only rank 0 samples.
Rank r owns query heads [r*Hq/N, (r+1)*Hq/N) and the KV heads those queries read,
[r*Hkv/N, (r+1)*Hkv/N): its KV pool holds only those heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class UnshardableModel(ValueError):
    """The model's heads or MLP width do not divide by the TP size; the message names both values."""


def check_divisible(tp_size: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
    """Refuse a TP size that would split a head, or give a rank no KV head (no replication here)."""
    if tp_size < 1:
        raise UnshardableModel(f"tp size must be at least 1, got {tp_size}")
    if num_kv_heads % tp_size:
        raise UnshardableModel(f"tp size {tp_size} does not divide the model's {num_kv_heads} KV heads "
                               "(each rank must own whole KV heads; KV-head replication is not supported)")
    if num_heads % tp_size:
        raise UnshardableModel(f"tp size {tp_size} does not divide the model's {num_heads} attention heads")
    if intermediate_size % tp_size:
        raise UnshardableModel(f"tp size {tp_size} does not divide the MLP width {intermediate_size}")


def check_tp_size(tp_size: int, model_config, ep_size: int = 1, attn_tp_size: int | None = None) -> None:
    """`check_divisible` for a loaded ModelConfig, naming the flag in the message. An MLA model
    (DeepSeek) has no KV heads to split: every rank holds the whole latent, only query heads divide.
    Under DP attention the heads split over `attn_tp_size` ranks (a DP group), the MLPs over tp_size.
    With `ep_size` > 1 (expert parallelism) the experts divide into ep_size blocks and each expert's
    width over the tp_size / ep_size ranks sharing a block."""
    attn = attn_tp_size or tp_size
    kv_heads = attn if model_config.mla is not None else model_config.num_kv_heads  # MLA: nothing to split
    try:
        check_divisible(attn, model_config.num_heads, kv_heads, model_config.intermediate_size * attn)
        if model_config.intermediate_size % tp_size:
            raise UnshardableModel(f"tp size {tp_size} does not divide the MLP width "
                                   f"{model_config.intermediate_size}")
    except UnshardableModel as exc:
        if attn != tp_size:
            raise UnshardableModel(f"--tp-size {tp_size} in {tp_size // attn} DP attention groups: "
                                   f"{exc}") from None
        raise UnshardableModel(f"--tp-size {tp_size}: {exc}") from None
    moe = model_config.moe
    if ep_size > 1 and moe is None:
        raise UnshardableModel(f"--ep-size {ep_size}: {model_config.architecture} has no routed experts to "
                               "split (expert parallelism, also implied by --moe-a2a-backend, is for MoE "
                               "models)")
    if moe is None:
        return
    if moe.num_experts % ep_size:
        raise UnshardableModel(f"--ep-size {ep_size} does not divide the model's {moe.num_experts} experts "
                               "(each EP rank owns a whole block of experts)")
    moe_tp_size = tp_size // ep_size  # ranks sharing one block of experts split each expert's columns
    if moe.intermediate_size % moe_tp_size:
        if ep_size == 1:
            raise UnshardableModel(f"--tp-size {tp_size}: tp size {tp_size} does not divide the expert width "
                                   f"{moe.intermediate_size}")
        raise UnshardableModel(f"--tp-size {tp_size} / --ep-size {ep_size}: the {moe_tp_size} ranks sharing "
                               f"each expert block do not divide the expert width {moe.intermediate_size}")


@dataclass(frozen=True)
class TPShard:
    """Rank `rank` of `size`; the slicing helpers take full checkpoint tensors and return this rank's part."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp rank {self.rank} outside 0..{self.size - 1}")

    def rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's block of dim 0 (output features of a column-parallel weight, or a bias)."""
        return tensor.chunk(self.size, dim=0)[self.rank].contiguous()

    def columns(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's block of dim 1 (input features of a row-parallel weight)."""
        return tensor.chunk(self.size, dim=1)[self.rank].contiguous()

    def row_bias(self, bias: torch.Tensor | None) -> torch.Tensor | None:
        """A row-parallel layer's bias is added once, on rank 0, before the partial sums are reduced."""
        return bias if self.rank == 0 else None
