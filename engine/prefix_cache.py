"""PrefixCache: full KV pages indexed by chained page hashes, shared read-only between requests.

A page enters the cache once it is full and its K/V computed (`insert`); from then on the
allocator keeps it when its last user lets go (idle, evicted least recently used first: see
libkv.allocator). `match` finds the longest run of a prompt's leading pages in the cache; the
caller retains them (a reference per request), so they cannot be evicted while in use. Nobody
writes into a full page, so sharing needs no copy.

Entries are keyed by page_hash (pdserve.page_hash), and each also keeps its tokens and its parent's
hash: a match compares them, so a hash collision (forged or not) is a miss, never another
prompt's K/V. Every change is reported to the listeners as a KV event: ("stored", hashes) and
("removed", hashes), in the order they happen (the worker publishes them to the gateway).

Not thread-safe by itself: the PageManager calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from libkv.allocator import PageAllocator
from pdserve.page_hash import ROOT_HASH, page_hashes

KvEventListener = Callable[[str, list[int]], None]  # (kind: "stored" | "removed", page hashes)


@dataclass(frozen=True)
class _Entry:
    page: int
    parent: int
    tokens: tuple[int, ...]


@dataclass
class PrefixCacheStats:
    """Running totals (never reset): hit/query tokens of admissions, evicted pages."""

    query_tokens: int = 0
    hit_tokens: int = 0
    evicted_pages: int = 0


class PrefixCache:
    """The index of cached pages over one allocator (see the module docstring)."""

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self._entries: dict[int, _Entry] = {}
        self._hash_of_page: dict[int, int] = {}
        self.stats = PrefixCacheStats()
        self.listeners: list[KvEventListener] = []
        allocator.on_evict = self._evicted

    @property
    def num_pages(self) -> int:
        """Pages indexed (in use or idle)."""
        return len(self._entries)

    def hashes(self) -> list[int]:
        """Every cached page's hash (a snapshot for a new KV-event subscriber)."""
        return list(self._entries)

    def match(self, token_ids: Sequence[int], max_pages: int, hashes: Sequence[int] | None = None) -> list[int]:
        """Pages holding the longest cached run of `token_ids`' leading full pages, at most
        `max_pages`. Not retained: the caller retains them before anything else allocates."""
        size = self.page_size
        max_pages = min(max_pages, len(token_ids) // size)
        if max_pages <= 0:
            return []
        if hashes is None or len(hashes) < max_pages:
            hashes = page_hashes(token_ids[:max_pages * size], size, hashes or ())
        pages: list[int] = []
        parent = ROOT_HASH
        for index in range(max_pages):
            entry = self._entries.get(hashes[index])
            if entry is None or entry.parent != parent or \
                    entry.tokens != tuple(token_ids[index * size:(index + 1) * size]):
                break
            pages.append(entry.page)
            parent = hashes[index]
        return pages

    def insert(self, token_ids: Sequence[int], page_ids: Sequence[int], hashes: Sequence[int],
               first: int = 0) -> None:
        """Index pages `first`.. of a sequence: page i of `page_ids` holds the computed K/V of
        tokens [i*page_size, (i+1)*page_size) and has hash `hashes[i]` (len(hashes) full pages).

        A hash already cached keeps its page (the other copy stays the sequence's own and is
        freed with it); so does a collision, which is left uncached."""
        size = self.page_size
        stored: list[int] = []
        for index in range(first, len(hashes)):
            digest = hashes[index]
            if digest in self._entries:
                continue
            page = page_ids[index]
            if page in self._hash_of_page:  # the page is already cached under another hash
                continue
            parent = hashes[index - 1] if index else ROOT_HASH
            self._entries[digest] = _Entry(page, parent, tuple(token_ids[index * size:(index + 1) * size]))
            self._hash_of_page[page] = digest
            self.allocator.mark_cacheable(page)
            stored.append(digest)
        if stored:
            self._publish("stored", stored)

    def _evicted(self, page: int) -> None:
        digest = self._hash_of_page.pop(page)
        del self._entries[digest]
        self.stats.evicted_pages += 1
        self._publish("removed", [digest])

    def _publish(self, kind: str, hashes: list[int]) -> None:
        for listener in list(self.listeners):
            listener(kind, hashes)
