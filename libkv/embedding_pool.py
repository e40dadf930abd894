"""EmbeddingPool: fixed-size pages of image embedding rows that a transfer engine moves (EPD).

An encoder service writes the embeddings of a request's images into the pages a language-only
worker reserved for them, over the same transfer backends, grants and checksums as KV pages. So
the pool *is* a KVPool, of an embedding layout: one layer, one plane ("latent"), `rows_per_page`
rows of `hidden` values per page (`embedding_layout`). Row r of a request's embeddings lives at
row r % rows_per_page of its page r // rows_per_page; images follow each other without gaps.
The backends compare layouts on connect, so encoder and worker must agree on hidden size, rows
per page and dtype (a mismatch names both values).

`EmbeddingPages` is its allocator: short verbs, one free list, exact page ids (tests pin them).
"""

from __future__ import annotations

import threading

import torch

from libkv.layout import KVLayout
from libkv.pool import KVPool

ROWS_PER_PAGE = 16


def embedding_layout(hidden: int, dtype: str, rows_per_page: int = ROWS_PER_PAGE) -> KVLayout:
    """The page layout of `rows_per_page` embedding rows of `hidden` values: an MLA-shaped layout
    of one layer (one plane, one "head" of `hidden` values per row), so a page is one contiguous
    block of rows and every transfer backend moves it unchanged."""
    return KVLayout.mla(num_layers=1, kv_lora_rank=hidden, qk_rope_head_dim=0, page_size=rows_per_page,
                        dtype=dtype)


class EmbeddingPool(KVPool):
    """`num_pages` embedding pages; `rows(pages, n)` reads the first n rows they hold, `put` writes them."""

    def __init__(self, hidden: int, dtype: str, num_pages: int, rows_per_page: int = ROWS_PER_PAGE) -> None:
        super().__init__(embedding_layout(hidden, dtype, rows_per_page), num_pages, "cpu")
        self.hidden = hidden
        self.rows_per_page = rows_per_page

    def pages_for(self, num_rows: int) -> int:
        return -(-num_rows // self.rows_per_page)

    def _page_rows(self, pages: list[int]) -> torch.Tensor:
        """The pages' rows back to back, [len(pages) * rows_per_page, hidden] (a copy)."""
        index = torch.tensor(pages, dtype=torch.long)
        return self.buffer.index_select(0, index).view(len(pages) * self.rows_per_page, self.hidden)

    def rows(self, pages: list[int], num_rows: int) -> torch.Tensor:
        """The first `num_rows` rows held by `pages` (in order), as a new tensor."""
        if self.pages_for(num_rows) != len(pages):
            raise ValueError(f"{num_rows} rows take {self.pages_for(num_rows)} pages, got {len(pages)}")
        return self._page_rows(pages)[:num_rows].clone()

    def put(self, pages: list[int], embeddings: torch.Tensor) -> None:
        """Write `embeddings` [rows, hidden] into `pages` (row r into page r // rows_per_page)."""
        num_rows = embeddings.shape[0]
        if embeddings.dim() != 2 or embeddings.shape[1] != self.hidden:
            raise ValueError(f"embeddings {tuple(embeddings.shape)} are not [rows, {self.hidden}]")
        if self.pages_for(num_rows) != len(pages):
            raise ValueError(f"{num_rows} rows take {self.pages_for(num_rows)} pages, got {len(pages)}")
        flat = self.buffer.view(self.num_pages, self.rows_per_page, self.hidden)
        values = embeddings.to(device=self.buffer.device, dtype=self.buffer.dtype)  # a tower may run on a GPU
        for i, page in enumerate(pages):
            chunk = values[i * self.rows_per_page:(i + 1) * self.rows_per_page]
            flat[page, :chunk.shape[0]] = chunk


class PagesExhausted(RuntimeError):
    """Not enough free embedding pages for a request."""


class EmbeddingPages:
    """The free list of an EmbeddingPool. Thread-safe. `allocate` takes the lowest free ids first
    (so tests can predict them); `free` gives pages back; `used` counts pages out."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free = list(range(num_pages))
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        with self._lock:
            return self.num_pages - len(self._free)

    def can_allocate(self, count: int) -> bool:
        with self._lock:
            return count <= len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count <= 0:
            raise ValueError(f"allocate needs a positive page count, got {count}")
        with self._lock:
            if count > len(self._free):
                raise PagesExhausted(f"{count} embedding pages wanted, "
                                     f"{len(self._free)} of {self.num_pages} free")
            self._free.sort()
            pages, self._free = self._free[:count], self._free[count:]
            return pages

    def free(self, pages: list[int]) -> None:
        with self._lock:
            held = set(range(self.num_pages)) - set(self._free)
            stray = [p for p in pages if p not in held]
            if stray:
                raise ValueError(f"embedding page {stray[0]} is not allocated")
            self._free.extend(pages)
