"""The embedding pool and its allocator (libkv/embedding_pool.py): exact rows, exact page ids."""

from __future__ import annotations

import pytest
import torch

from libkv.embedding_pool import EmbeddingPages, EmbeddingPool, PagesExhausted, embedding_layout


def test_layout_is_one_block_of_rows_per_page():
    layout = embedding_layout(128, "float32")
    assert layout.page_shape == (1, 1, 16, 1, 128)
    assert layout.page_nbytes == 16 * 128 * 4
    assert embedding_layout(128, "bfloat16").differences(layout) == ["dtype: bfloat16 vs float32"]


def test_rows_round_trip_over_pages_with_a_partial_last_page():
    pool = EmbeddingPool(hidden=8, dtype="float32", num_pages=6, rows_per_page=4)
    rows = torch.arange(10 * 8, dtype=torch.float32).view(10, 8)
    pool.put([5, 1, 3], rows)  # pages need not be consecutive: row r goes to pages[r // 4]
    assert torch.equal(pool.rows([5, 1, 3], 10), rows)
    assert torch.equal(pool.buffer.view(6, 4, 8)[1, 0], rows[4])
    with pytest.raises(ValueError, match="10 rows take 3 pages, got 2"):
        pool.rows([5, 1], 10)
    with pytest.raises(ValueError, match=r"not \[rows, 8\]"):
        pool.put([0], torch.zeros(2, 7))


def test_landing_check_sees_the_write_only_after_poison():
    """What the client relies on: a poisoned page matches the sender's checksum only once the
    sender's bytes are in it, even when the page held those very bytes before."""
    sender = EmbeddingPool(hidden=8, dtype="float32", num_pages=2, rows_per_page=4)
    receiver = EmbeddingPool(hidden=8, dtype="float32", num_pages=2, rows_per_page=4)
    rows = torch.randn(4, 8)
    sender.put([1], rows)
    receiver.put([0], rows)  # the same bytes, left by an earlier request
    sent = sender.page_checksums([1])
    assert receiver.page_checksums([0]) == sent
    receiver.poison([0])
    assert receiver.page_checksums([0]) != sent
    receiver.buffer[0].copy_(sender.buffer[1])  # the write lands
    assert receiver.page_checksums([0]) == sent


def test_allocator_gives_lowest_ids_first_and_takes_them_back():
    pages = EmbeddingPages(5)
    assert pages.allocate(2) == [0, 1]
    assert pages.allocate(2) == [2, 3]
    assert pages.used == 4
    pages.free([0, 1])
    assert pages.allocate(3) == [0, 1, 4]
    assert not pages.can_allocate(1)
    with pytest.raises(PagesExhausted, match="1 embedding pages wanted, 0 of 5 free"):
        pages.allocate(1)
    pages.free([2, 3, 0, 1, 4])
    assert pages.used == 0
    with pytest.raises(ValueError, match="page 2 is not allocated"):
        pages.free([2])
    with pytest.raises(ValueError, match="positive"):
        pages.allocate(0)
