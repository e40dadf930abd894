"""EmbeddingCache (services/worker/embedding_cache.py): hits, misses, least recently used out first."""

from __future__ import annotations

import pytest
import torch

from services.worker.embedding_cache import EmbeddingCache


def rows(value: float) -> torch.Tensor:
    return torch.full((2, 4), value)


def test_hits_and_misses_are_counted():
    cache = EmbeddingCache(2)
    assert cache.get(1) is None
    cache.put(1, rows(1.0))
    assert torch.equal(cache.get(1), rows(1.0))
    assert (cache.hits, cache.misses, len(cache)) == (1, 1, 1)


def test_least_recently_used_goes_first():
    cache = EmbeddingCache(2)
    cache.put(1, rows(1.0))
    cache.put(2, rows(2.0))
    cache.get(1)  # 2 is now the least recently used
    cache.put(3, rows(3.0))
    assert cache.get(2) is None
    assert cache.get(1) is not None and cache.get(3) is not None
    assert len(cache) == 2


def test_capacity_zero_keeps_nothing_and_negative_is_refused():
    cache = EmbeddingCache(0)
    cache.put(1, rows(1.0))
    assert cache.get(1) is None and len(cache) == 0
    with pytest.raises(ValueError, match=">= 0"):
        EmbeddingCache(-1)
