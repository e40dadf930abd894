"""KVPool: the memory that holds every page of K and V for one worker."""

from __future__ import annotations

import torch

from libkv.layout import KVLayout


class KVPool:
    """Page-major KV storage: `buffer[page, layer, k_or_v, slot, kv_head, head_dim]`.

    Page-major means one page (all layers, K and V) is one contiguous block of
    `layout.page_nbytes` bytes, so a run of consecutive page ids is one contiguous region and
    moves as a single transfer-engine write. Attention reads a layer's K or V through the strided
    views `k_cache(layer)` / `v_cache(layer)` of shape [num_pages, page_size, kv_heads, head_dim].
    """

    def __init__(self, layout: KVLayout, num_pages: int, device: str | torch.device = "cpu") -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.layout = layout
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.buffer = torch.zeros((num_pages, *layout.page_shape), dtype=layout.torch_dtype,
                                  device=self.device)

    def k_cache(self, layer: int) -> torch.Tensor:
        return self.buffer[:, layer, 0]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self.buffer[:, layer, 1]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def data_ptr(self) -> int:
        return self.buffer.data_ptr()

    def page_offset(self, page: int) -> int:
        """Byte offset of a page from the start of the buffer."""
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page {page} outside pool of {self.num_pages} pages")
        return page * self.layout.page_nbytes

    def as_bytes(self) -> torch.Tensor:
        """The whole pool as a flat uint8 view (for transfer engines that address bytes)."""
        return self.buffer.view(-1).view(torch.uint8)

    @staticmethod
    def num_pages_for_budget(layout: KVLayout, budget_bytes: int) -> int:
        return max(budget_bytes // layout.page_nbytes, 0)
