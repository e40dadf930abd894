"""Who owns which KV pages: PageManager (pages of requests, reservations and held pages, on top of
libkv's PageAllocator) and the PrefixCache over them, its index of full pages by content.

PrefixCache: full KV pages indexed by chained page hashes, shared read-only between requests.

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

import threading
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

    def match(self, token_ids: Sequence[int], max_pages: int,
              hashes: Sequence[int] | None = None) -> list[int]:
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


@dataclass(frozen=True)
class Reservation:
    """Pages set aside under a room for a prompt whose K/V arrives by transfer (decode side).

    `pages` covers the whole prompt in order; its first `cached_pages` come from this worker's
    prefix cache (already holding the prompt's K/V, shared read-only), so only `tail` needs writing.
    """

    pages: list[int]
    cached_pages: int = 0

    @property
    def tail(self) -> list[int]:
        return self.pages[self.cached_pages:]


class PageManager:
    """Who owns which pages. Three kinds of owner:

    - a running request: its `page_ids` list, grown with `grow` as tokens are added, emptied by `free`;
    - a reservation (decode side of PD): pages set aside by `reserve` for a prompt whose KV will
      arrive by transfer, handed to a request by `take_reserved` or given back by `release`;
    - a hold (prefill side of PD): the pages of a finished prefill, kept by `hold` until the
      KV transfer is done and the service calls `release`.

    With `prefix_cache`, full pages whose K/V is computed are indexed by content (`cache_pages`)
    and a new prompt starts from the longest cached run of its leading pages (`acquire_prefix`,
    `reserve_prompt`). Cached pages nobody uses are idle: they count as free (`free_pages`,
    `used_pages`), and allocation evicts them, least recently released first, when it must.

    Methods are thread-safe: the engine thread grows and frees, service threads reserve and release.
    """

    def __init__(self, num_pages: int, page_size: int, prefix_cache: bool = False) -> None:
        self.allocator = PageAllocator(num_pages)
        self.page_size = page_size
        self.cache = PrefixCache(self.allocator, page_size) if prefix_cache else None
        self._lock = threading.Lock()
        self._by_room: dict[str, list[int]] = {}  # reservations and holds
        self._freed_listeners: list[Callable[[], None]] = []

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def free_pages(self) -> int:
        return self.allocator.free_pages

    @property
    def used_pages(self) -> int:
        return self.allocator.used_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def grow(self, page_ids: list[int], num_tokens: int, keep_free: int = 0) -> bool:
        """Append pages to `page_ids` until they hold `num_tokens`; False (and no change) if that
        would leave fewer than `keep_free` pages free."""
        missing = self.pages_for(num_tokens) - len(page_ids)
        if missing <= 0:
            return True
        with self._lock:
            if self.allocator.free_pages - missing < keep_free:
                return False
            page_ids.extend(self.allocator.allocate(missing))
        return True

    def free(self, page_ids: list[int]) -> None:
        """Give back every page in the list and empty it. Released last page first, so of a
        sequence's cached pages the later ones (leaves of the prefix tree) are evicted first."""
        with self._lock:
            self.allocator.release(reversed(page_ids))
            listeners = list(self._freed_listeners) if page_ids else []
        page_ids.clear()
        for listener in listeners:
            listener()

    def on_freed(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call `listener()` whenever pages are given back (`free`, `release`), from the thread that
        gives them back, until the returned function is called. For a waiter that polls nothing:
        it tries to reserve, and tries again when told."""
        with self._lock:
            self._freed_listeners.append(listener)

        def stop() -> None:
            with self._lock:
                if listener in self._freed_listeners:
                    self._freed_listeners.remove(listener)
        return stop

    def retain(self, page_ids: Sequence[int]) -> None:
        """Add a reference to pages in use or idle in the cache (the store tier keeps pages it has
        yet to copy out this way; it gives them back with `free`)."""
        with self._lock:
            self.allocator.retain(page_ids)

    # ---- prefix cache ---------------------------------------------------------------------------
    def acquire_prefix(self, token_ids: Sequence[int], max_pages: int,
                       hashes: Sequence[int] | None = None) -> list[int]:
        """The cached pages of the longest run of `token_ids`' leading full pages (at most
        `max_pages`), each retained for the caller (who frees them like its other pages)."""
        if self.cache is None or max_pages <= 0:
            return []
        with self._lock:
            pages = self.cache.match(token_ids, max_pages, hashes)
            self.allocator.retain(pages)
        return pages

    def cache_pages(self, token_ids: Sequence[int], page_ids: Sequence[int], hashes: Sequence[int],
                    first: int = 0) -> None:
        """Index the full computed pages `first`..len(hashes) of a sequence (see PrefixCache.insert)."""
        if self.cache is None:
            return
        with self._lock:
            self.cache.insert(token_ids, page_ids, hashes, first)

    def cached_prefix_pages(self, token_ids: Sequence[int], hashes: Sequence[int] | None = None) -> int:
        """How many of `token_ids`' leading full pages the cache holds now (retains nothing)."""
        if self.cache is None:
            return 0
        with self._lock:
            return len(self.cache.match(token_ids, len(token_ids) // self.page_size, hashes))

    def watch_cache(self, listener) -> list[int]:
        """Call `listener(kind, hashes)` on every change of the cache from now on (under this
        manager's lock: keep it short) and return the hashes cached now: taken together, so no
        change is missed or seen twice. Empty, and nothing called, when the cache is off."""
        if self.cache is None:
            return []
        with self._lock:
            self.cache.listeners.append(listener)
            return self.cache.hashes()

    def unwatch_cache(self, listener) -> None:
        if self.cache is not None:
            with self._lock:
                if listener in self.cache.listeners:
                    self.cache.listeners.remove(listener)

    def count_query(self, query_tokens: int, hit_tokens: int) -> None:
        """Record one prompt's lookup (for the hit-rate metrics)."""
        if self.cache is not None:
            with self._lock:
                self.cache.stats.query_tokens += query_tokens
                self.cache.stats.hit_tokens += hit_tokens

    def reserve_prompt(self, room: str, token_ids: Sequence[int],
                       hashes: Sequence[int] | None = None) -> Reservation | None:
        """Set aside pages for a prompt under `room`, its leading full pages from the cache when
        they are there; None if not enough pages are free. Every full page may come from the
        cache: nothing is computed here, and decoding writes only past the prompt. `hashes`:
        the prompt's page hashes, if the caller has them (a caller that retries passes them)."""
        if self.cache is not None and hashes is None:
            hashes = page_hashes(token_ids, self.page_size)  # outside the lock
        with self._lock:
            if room in self._by_room:
                raise ValueError(f"room {room!r} already has reserved or held pages")
            cached: list[int] = []
            if self.cache is not None:
                cached = self.cache.match(token_ids, len(token_ids) // self.page_size, hashes)
                self.allocator.retain(cached)
            need = self.pages_for(len(token_ids)) - len(cached)
            if not self.allocator.can_allocate(need):
                self.allocator.release(reversed(cached))
                return None
            pages = cached + self.allocator.allocate(need)
            self._by_room[room] = pages
            if self.cache is not None:
                self.cache.stats.query_tokens += len(token_ids)
                self.cache.stats.hit_tokens += len(cached) * self.page_size
            return Reservation(list(pages), len(cached))

    def reserve(self, room: str, num_tokens: int) -> list[int] | None:
        """Set aside pages for `num_tokens` under `room`; None if not enough pages are free."""
        with self._lock:
            if room in self._by_room:
                raise ValueError(f"room {room!r} already has reserved or held pages")
            need = self.pages_for(num_tokens)
            if not self.allocator.can_allocate(need):
                return None
            pages = self.allocator.allocate(need)
            self._by_room[room] = pages
            return list(pages)

    def take_reserved(self, room: str) -> list[int]:
        """Move a reservation's pages to the caller (a request that now owns them)."""
        with self._lock:
            if room not in self._by_room:
                raise KeyError(f"room {room!r} has no reserved pages")
            return self._by_room.pop(room)

    def hold(self, room: str, page_ids: list[int]) -> None:
        """Keep a finished request's pages under `room` until `release(room)`."""
        with self._lock:
            if room in self._by_room:
                raise ValueError(f"room {room!r} already has reserved or held pages")
            self._by_room[room] = list(page_ids)
        page_ids.clear()

    def release(self, room: str) -> bool:
        """Free a reservation or hold; False if `room` has none (already released, or never had)."""
        with self._lock:
            pages = self._by_room.pop(room, None)
            if pages is None:
                return False
            self.allocator.release(reversed(pages))
            listeners = list(self._freed_listeners)
        for listener in listeners:
            listener()
        return True

    def has_room(self, room: str) -> bool:
        with self._lock:
            return room in self._by_room

    def pages_by_room(self) -> dict[str, int]:
        """How many pages each reservation or hold has (a snapshot)."""
        with self._lock:
            return {room: len(pages) for room, pages in self._by_room.items()}

    @property
    def num_rooms(self) -> int:
        return len(self._by_room)

    @property
    def reserved_pages(self) -> int:
        """Pages set aside by reservations and holds (PD), not owned by a running request."""
        with self._lock:
            return sum(len(pages) for pages in self._by_room.values())
