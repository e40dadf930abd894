"""PageManager: KV pages of requests, reservations and held pages, on top of libkv's PageAllocator."""

from __future__ import annotations

import threading

from libkv.allocator import PageAllocator


class PageManager:
    """Who owns which pages. Three kinds of owner:

    - a running request: its `page_ids` list, grown with `grow` as tokens are added, emptied by `free`;
    - a reservation (decode side of PD): pages set aside by `reserve` for a prompt whose KV will
      arrive by transfer, handed to a request by `take_reserved` or given back by `release`;
    - a hold (prefill side of PD): the pages of a finished prefill, kept by `hold` until the
      KV transfer is done and the service calls `release`.

    Methods are thread-safe: the engine thread grows and frees, service threads reserve and release.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.allocator = PageAllocator(num_pages)
        self.page_size = page_size
        self._lock = threading.Lock()
        self._by_room: dict[str, list[int]] = {}  # reservations and holds

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
        """Give back every page in the list and empty it."""
        with self._lock:
            self.allocator.release(page_ids)
        page_ids.clear()

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
            self.allocator.release(pages)
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
