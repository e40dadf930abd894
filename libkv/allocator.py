"""PageAllocator: which KV pages are free, with reference counts for shared pages, and the idle
pages a prefix cache keeps (evicted least recently used first when free pages run out)."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable


class OutOfPages(RuntimeError):
    """Raised by allocate() when fewer pages are free than asked for; nothing is allocated then."""


class PageAllocator:
    """Hands out page ids from a fixed pool.

    Free pages are kept in a min-heap so allocation is deterministic and prefers low ids; pages
    freed together tend to be handed out together again, which keeps page runs contiguous
    (fewer, larger transfers). A page is in use while its reference count is above zero.

    A page marked `cacheable` (a prefix cache indexes its content) does not go back to the heap
    when its count reaches zero: it becomes *idle*, still holding its K/V, in an LRU list in the
    order it was released. `retain` brings an idle page back into use (a cache hit). `allocate`
    takes heap pages first and then evicts idle pages, oldest first, telling `on_evict` so the
    cache forgets them. Idle pages count as free: nobody uses them and they can be handed out.
    A page in use is never evicted.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages))  # already a valid heap
        self._refs = [0] * num_pages
        self._cacheable = [False] * num_pages
        self._idle: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self.on_evict: Callable[[int], None] | None = None

    @property
    def free_pages(self) -> int:
        """Pages that can be allocated: never used or given back, plus idle cached pages."""
        return len(self._free) + len(self._idle)

    @property
    def used_pages(self) -> int:
        """Pages with a reference count above zero."""
        return self.num_pages - self.free_pages

    @property
    def idle_pages(self) -> int:
        """Cached pages nobody uses (evictable; counted in free_pages)."""
        return len(self._idle)

    def idle_order(self) -> list[int]:
        """Idle pages in eviction order (the next evicted first)."""
        return list(self._idle)

    def can_allocate(self, n: int) -> bool:
        return n <= self.free_pages

    def allocate(self, n: int) -> list[int]:
        """Take `n` pages, each with reference count 1: free pages (lowest ids first), then idle
        cached pages (least recently released first; each eviction is reported to `on_evict`)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self.free_pages:
            raise OutOfPages(f"asked for {n} pages, {self.free_pages} of {self.num_pages} free")
        pages = [heapq.heappop(self._free) for _ in range(min(n, len(self._free)))]
        while len(pages) < n:
            page, _ = self._idle.popitem(last=False)
            self._cacheable[page] = False
            if self.on_evict is not None:
                self.on_evict(page)
            pages.append(page)
        for page in pages:
            self._refs[page] = 1
        return pages

    def retain(self, pages: Iterable[int]) -> None:
        """Add a reference to pages in use (e.g. a shared prefix) or idle in the cache (a hit)."""
        for page in pages:
            if self._refs[page] <= 0:
                if page not in self._idle:
                    raise ValueError(f"page {page} is free; cannot retain it")
                del self._idle[page]
            self._refs[page] += 1

    def release(self, pages: Iterable[int]) -> None:
        """Drop one reference from each page; at zero a page becomes free, or idle if cacheable
        (the later in `pages`, the longer it stays idle before eviction)."""
        for page in pages:
            if self._refs[page] <= 0:
                raise ValueError(f"page {page} is already free (double release)")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if self._cacheable[page]:
                    self._idle[page] = None
                else:
                    heapq.heappush(self._free, page)

    def mark_cacheable(self, page: int) -> None:
        """A prefix cache now indexes this page (in use): keep its K/V when it becomes unused."""
        if self._refs[page] <= 0:
            raise ValueError(f"page {page} is not in use; only a page in use can be cached")
        self._cacheable[page] = True

    def is_cacheable(self, page: int) -> bool:
        return self._cacheable[page]

    def ref_count(self, page: int) -> int:
        return self._refs[page]
