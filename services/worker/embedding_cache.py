"""EmbeddingCache: a language-only worker's image embeddings by image digest, least recently used
out first, so the same image twice is encoded once.

The key is ImageInput.digest (a hash of the preprocessed pixels and their grid, the same digest
the prefix cache salts pages with), so two encodings of one picture that preprocess to the same
pixels share an entry, and different pictures never do. Values are the image's rows [n, hidden],
copied out of the embedding pages (the pages are freed as soon as a request has its rows).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch


class EmbeddingCache:
    """At most `capacity` images (0 = off). `get` counts a hit or a miss; thread-safe."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"embedding cache capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, digest: int) -> torch.Tensor | None:
        with self._lock:
            rows = self._entries.get(digest)
            if rows is None:
                self.misses += 1
                return None
            self._entries.move_to_end(digest)
            self.hits += 1
            return rows

    def put(self, digest: int, rows: torch.Tensor) -> None:
        if self.capacity == 0:
            return
        with self._lock:
            self._entries[digest] = rows
            self._entries.move_to_end(digest)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
