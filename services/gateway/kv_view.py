"""KvCacheView: what the gateway knows of one worker's prefix cache, from its KV events."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class KvCacheView:
    """The page hashes a worker caches now (pdserve/page_hash.py), kept by kv_events.py.

    `synced` is true while the worker's event stream is up and its snapshot applied; otherwise the
    view says nothing (a stream that broke may have missed events, so its hashes are dropped)."""

    page_size: int = 0
    hashes: set[int] = field(default_factory=set)
    synced: bool = False

    def apply(self, snapshot: bool, stored: Sequence[int] = (), removed: Sequence[int] = ()) -> None:
        if snapshot:
            self.hashes = set()
        self.hashes.update(stored)
        self.hashes.difference_update(removed)

    def forget(self) -> None:
        self.hashes = set()
        self.synced = False

    def cached_pages(self, prompt_hashes: Sequence[int]) -> int:
        """How many of a prompt's leading pages the worker holds (the chain stops at the first miss)."""
        count = 0
        for digest in prompt_hashes:
            if digest not in self.hashes:
                break
            count += 1
        return count
