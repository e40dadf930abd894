"""KvCacheView: what the gateway knows of one worker's prefix cache, from its KV events.

Memory is bounded per worker: each medium's hashes are a PageSet of at most MAX_VIEW_PAGES hashes
(about 100 bytes each: 6.5 MB per worker and medium at the default), and past that the hash stored
earliest is dropped first. A worker's own REMOVED events keep its view no larger than its cache, so
the cap binds only for a worker caching more pages than that; a dropped hash is a page the policy no
longer counts (a missed cache hit, never a wrong answer).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice, repeat

MAX_VIEW_PAGES = 1 << 16  # per worker and medium: 1M tokens of KV at 16-token pages


class PageSet(dict[int, None]):
    """Page hashes in the order they were stored, at most `max_pages` of them (the earliest stored
    are dropped first; `dropped` counts them). A plain dict (insertion-ordered): membership, size and
    iteration are C calls on the routing path, and storing or removing a batch of hashes runs in C
    with no bytecode per hash (an OrderedDict took about 1 us per stored hash: its linked list; KV
    events at GPU rates store and remove hundreds of thousands of hashes a second). Equal to a set of
    the same hashes."""

    def __init__(self, hashes: Iterable[int] = (), max_pages: int = MAX_VIEW_PAGES) -> None:
        super().__init__()
        self.max_pages = max_pages
        self.dropped = 0
        self.store(hashes)

    def store(self, hashes: Iterable[int]) -> None:
        self.update(dict.fromkeys(hashes))  # a hash stored again keeps its place
        overflow = len(self) - self.max_pages
        if overflow > 0:
            self.dropped += overflow
            self.remove(list(islice(self, overflow)))  # the earliest stored: a dict iterates in order

    def remove(self, hashes: Iterable[int]) -> None:
        deque(map(self.pop, hashes, repeat(None)), maxlen=0)  # pop(hash, None) per hash, looped in C

    def __eq__(self, other: object) -> bool:  # against a set (tests) or another PageSet
        if isinstance(other, (set, frozenset)):
            return self.keys() == other
        return super().__eq__(other)

    def __repr__(self) -> str:
        return f"PageSet({len(self)} of at most {self.max_pages})"


@dataclass(eq=False)
class KvCacheView:
    """The page hashes (pdserve/page_hash.py) a worker holds now, by medium, kept by kv_events.py.

    `hashes`: its own KV pool (KV_MEDIUM_DEVICE, a local hit). `store_hashes`: pages it knows are in
    the cluster-wide store `store` (KV_MEDIUM_STORE, --enable-hierarchical-cache; "" without one),
    which every worker on that store can fetch. `synced` is true while the worker's event stream is
    up and its snapshot applied; otherwise the view says nothing (a stream that broke may have
    missed events, so its hashes are dropped). Each medium holds at most `max_pages` hashes (see the
    module docstring)."""

    page_size: int = 0
    hashes: PageSet = field(default_factory=PageSet)
    store: str = ""
    store_hashes: PageSet = field(default_factory=PageSet)
    synced: bool = False
    max_pages: int = MAX_VIEW_PAGES

    def apply(self, snapshot: bool, stored: Sequence[int] = (), removed: Sequence[int] = (), *,
              in_store: bool = False) -> None:
        """Apply one event (`in_store`: a KV_MEDIUM_STORE one); a snapshot clears both media first."""
        if snapshot:
            self.hashes, self.store_hashes = self._empty(), self._empty()
        held = self.store_hashes if in_store else self.hashes
        held.store(stored)
        held.remove(removed)

    def _empty(self) -> PageSet:
        return PageSet(max_pages=self.max_pages)

    def forget(self) -> None:
        self.hashes, self.store_hashes = self._empty(), self._empty()
        self.synced = False

    def cached_pages(self, prompt_hashes: Sequence[int]) -> int:
        """How many of a prompt's leading pages the worker holds (the chain stops at the first miss)."""
        return leading_run(prompt_hashes, [self.hashes])


def leading_run(prompt_hashes: Sequence[int], held: Sequence[Container[int]], start: int = 0) -> int:
    """How many of `prompt_hashes[start:]` are in one of the sets `held`, counted until the first that
    is in none (membership per page: no union of the sets is built for one routing decision)."""
    count = 0
    if len(held) == 1:  # one medium (nearly every call): no generator per page
        only = held[0]
        for index in range(start, len(prompt_hashes)):
            if prompt_hashes[index] not in only:
                break
            count += 1
        return count
    for index in range(start, len(prompt_hashes)):
        digest = prompt_hashes[index]
        if not any(digest in hashes for hashes in held):
            break
        count += 1
    return count



def leading_runs(prompt_hashes: Iterable[int], held: Sequence[Container[int]]) -> list[int]:
    """For each set in `held`, how many of the prompt's leading hashes it holds (as leading_run).
    `prompt_hashes` is read lazily, no further than the longest run needs plus one page: most of a
    64-worker fleet misses on the first page, and every worker on the first page of a prompt's unique
    suffix, so a lazy hasher (page_hash.iter_page_hashes) hashes no page past that."""
    pages = iter(prompt_hashes)  # (a list would start over for each set)
    hashes: list[int] = []
    runs = [0] * len(held)
    for index, only in enumerate(held):
        count = 0
        for digest in hashes:  # the pages hashed so far
            if digest not in only:
                break
            count += 1
        else:  # it holds every page hashed so far: hash on
            for digest in pages:
                hashes.append(digest)
                if digest not in only:
                    break
                count += 1
        runs[index] = count
    return runs
