"""KvCacheView: what the gateway knows of one worker's prefix cache, from its KV events."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class KvCacheView:
    """The page hashes (pdserve/page_hash.py) a worker holds now, by medium, kept by kv_events.py.

    `hashes`: its own KV pool (KV_MEDIUM_DEVICE, a local hit). `store_hashes`: pages it knows are in
    the cluster-wide store `store` (KV_MEDIUM_STORE, --enable-hierarchical-cache; "" without one),
    which every worker on that store can fetch. `synced` is true while the worker's event stream is
    up and its snapshot applied; otherwise the view says nothing (a stream that broke may have
    missed events, so its hashes are dropped)."""

    page_size: int = 0
    hashes: set[int] = field(default_factory=set)
    store: str = ""
    store_hashes: set[int] = field(default_factory=set)
    synced: bool = False

    def apply(self, snapshot: bool, stored: Sequence[int] = (), removed: Sequence[int] = (), *,
              in_store: bool = False) -> None:
        """Apply one event (`in_store`: a KV_MEDIUM_STORE one); a snapshot clears both media first."""
        if snapshot:
            self.hashes, self.store_hashes = set(), set()
        held = self.store_hashes if in_store else self.hashes
        held.update(stored)
        held.difference_update(removed)

    def forget(self) -> None:
        self.hashes, self.store_hashes = set(), set()
        self.synced = False

    def cached_pages(self, prompt_hashes: Sequence[int]) -> int:
        """How many of a prompt's leading pages the worker holds (the chain stops at the first miss)."""
        return leading_run(prompt_hashes, [self.hashes])


def leading_run(prompt_hashes: Sequence[int], held: Sequence[set[int]], start: int = 0) -> int:
    """How many of `prompt_hashes[start:]` are in one of the sets `held`, counted until the first that
    is in none (membership per page: no union of the sets is built for one routing decision)."""
    count = 0
    for digest in prompt_hashes[start:]:
        if not any(digest in hashes for hashes in held):
            break
        count += 1
    return count
