"""The KV-cache ops the engine and transfer backends call, dispatched by device.

CUDA tensors go to the Triton kernels (kernels.triton_kv, kernels.triton_attention); anything else
to the vectorized torch implementations (kernels.torch_ops), which are also the references the
kernels are tested against. Both are reachable by explicit name: `store_kv_torch`,
`store_kv_triton`, and so on. Triton is imported only when a CUDA tensor (or an explicit
`*_triton` name) asks for it, so CPU-only processes never pay for it.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import torch

from kernels.torch_ops import (
    gather_kv_torch,
    gather_pages_torch,
    paged_decode_attention_torch,
    scatter_pages_torch,
    store_kv_torch,
)

__all__ = [
    "store_kv", "paged_decode_attention", "gather_kv", "gather_pages", "scatter_pages",
    "store_kv_torch", "paged_decode_attention_torch", "gather_kv_torch", "gather_pages_torch",
    "scatter_pages_torch",
]  # the *_triton names resolve lazily through __getattr__ below

# Triton entry point -> module that defines it (imported on first use).
_TRITON_MODULES = {
    "store_kv_triton": "kernels.triton_kv",
    "gather_kv_triton": "kernels.triton_kv",
    "gather_pages_triton": "kernels.triton_kv",
    "scatter_pages_triton": "kernels.triton_kv",
    "paged_decode_attention_triton": "kernels.triton_attention",
    "lora_delta_add_triton": "kernels.triton_lora",
}


def __getattr__(name: str):
    if name in _TRITON_MODULES:
        return getattr(importlib.import_module(_TRITON_MODULES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _triton(name: str):
    return __getattr__(name)


def _as_ids(page_ids: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    if isinstance(page_ids, torch.Tensor):
        return page_ids.to(device=device, dtype=torch.long)
    return torch.tensor(list(page_ids), dtype=torch.long, device=device)


def store_kv(buffer: torch.Tensor, layer: int, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Write new K/V of T tokens ([T, Hkv, D] each) into their slots ([T]) of `layer`."""
    if buffer.is_cuda:
        _triton("store_kv_triton")(buffer, layer, slots, k, v)
    else:
        store_kv_torch(buffer, layer, slots, k, v)


def paged_decode_attention(q: torch.Tensor, buffer: torch.Tensor, layer: int,
                           page_table: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Decode attention: q [B, Hq, D] over each sequence's first seq_lens[b] cached tokens -> [B, Hq, D].

    page_table [B, max_pages] lists each sequence's pages in order; the current token's K/V must
    already be stored. Softmax runs in fp32; the output has q's dtype.
    """
    if buffer.is_cuda:
        return _triton("paged_decode_attention_triton")(q, buffer, layer, page_table, seq_lens, scale)
    return paged_decode_attention_torch(q, buffer, layer, page_table, seq_lens, scale)


def gather_kv(buffer: torch.Tensor, layer: int, page_ids: torch.Tensor,
              num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ([num_tokens, Hkv, D] each, contiguous) of a request's first num_tokens tokens."""
    ids = _as_ids(page_ids, buffer.device)
    if buffer.is_cuda:
        return _triton("gather_kv_triton")(buffer, layer, ids, num_tokens)
    return gather_kv_torch(buffer, layer, ids, num_tokens)


def gather_pages(buffer: torch.Tensor, page_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Contiguous copy [n, L, 2, P, Hkv, D] of whole pages, in the order of page_ids."""
    ids = _as_ids(page_ids, buffer.device)
    if buffer.is_cuda:
        return _triton("gather_pages_triton")(buffer, ids)
    return gather_pages_torch(buffer, ids)


def scatter_pages(buffer: torch.Tensor, page_ids: torch.Tensor | Sequence[int],
                  src: torch.Tensor) -> None:
    """Write src[i] (one whole page, [L, 2, P, Hkv, D]) into page page_ids[i] of buffer."""
    ids = _as_ids(page_ids, buffer.device)
    if buffer.is_cuda and src.is_cuda:
        _triton("scatter_pages_triton")(buffer, ids, src)
    else:
        # Host<->device staging goes through torch: index_copy_ moves src to the pool's device.
        scatter_pages_torch(buffer, ids, src)
