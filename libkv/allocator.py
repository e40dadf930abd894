"""PageAllocator: which KV pages are free, with reference counts for shared pages."""

from __future__ import annotations

import heapq
from collections.abc import Iterable


class OutOfPages(RuntimeError):
    """Raised by allocate() when fewer pages are free than asked for; nothing is allocated then."""


class PageAllocator:
    """Hands out page ids from a fixed pool.

    Free pages are kept in a min-heap so allocation is deterministic and prefers low ids; pages
    freed together tend to be handed out together again, which keeps page runs contiguous
    (fewer, larger transfers). A page is free when its reference count drops to zero.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages))  # already a valid heap
        self._refs = [0] * num_pages

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free pages (lowest ids first), each with reference count 1."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} of {self.num_pages} free")
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for page in pages:
            self._refs[page] = 1
        return pages

    def retain(self, pages: Iterable[int]) -> None:
        """Add a reference to pages that are already allocated (e.g. a shared prefix)."""
        for page in pages:
            if self._refs[page] <= 0:
                raise ValueError(f"page {page} is free; cannot retain it")
            self._refs[page] += 1

    def release(self, pages: Iterable[int]) -> None:
        """Drop one reference from each page; pages whose count reaches zero become free."""
        for page in pages:
            if self._refs[page] <= 0:
                raise ValueError(f"page {page} is already free (double release)")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                heapq.heappush(self._free, page)

    def ref_count(self, page: int) -> int:
        return self._refs[page]
