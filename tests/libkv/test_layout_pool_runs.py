import pytest
import torch
import xxhash

from libkv import KVLayout, KVPool, LayoutMismatch
from libkv.pool import PageRun, coalesce


def test_page_bytes_and_pool_views():
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, page_size=5, dtype="float32")
    assert layout.page_nbytes == 3 * 2 * 5 * 2 * 4 * 4
    assert layout.pages_for(11) == 3 and layout.pages_for(10) == 2
    pool = KVPool(layout, num_pages=6)
    assert pool.nbytes == 6 * layout.page_nbytes
    pool.k_cache(1)[4].fill_(7.0)
    # page-major: page 4 is one contiguous block and layer 1's K lies inside it
    block = pool.as_bytes()[pool.page_offset(4): pool.page_offset(4) + layout.page_nbytes]
    assert block.view(torch.float32).sum().item() == 7.0 * 5 * 2 * 4
    assert pool.k_cache(1).shape == (6, 5, 2, 4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_page_checksums_are_xxh3_of_each_page_and_see_one_byte(dtype):
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=dtype)
    pool = KVPool(layout, num_pages=5)
    pool.buffer.normal_(generator=torch.Generator().manual_seed(0))
    # Independently: copy each page's bytes out of the tensor and hash the copy.
    expected = [xxhash.xxh3_64_intdigest(pool.buffer[p].clone().view(-1).view(torch.uint8).numpy().tobytes())
                for p in range(5)]
    assert pool.page_checksums([4, 0, 2]) == [expected[4], expected[0], expected[2]]
    assert len(set(expected)) == 5
    pool.as_bytes()[pool.page_offset(2) + layout.page_nbytes - 1] ^= 1  # last byte of page 2
    after = pool.page_checksums(list(range(5)))
    assert [a != e for a, e in zip(after, expected, strict=True)] == [False, False, True, False, False]
    assert pool.page_checksums([]) == []
    with pytest.raises(IndexError):
        pool.page_checksums([5])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_poisoned_pages_are_nan_everywhere_and_no_other_page_changes(dtype):
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=dtype)
    pool = KVPool(layout, num_pages=5)
    pool.buffer.normal_(generator=torch.Generator().manual_seed(0))
    before = pool.buffer.clone()
    pool.poison([3, 1])
    assert pool.buffer[[1, 3]].isnan().all()
    assert torch.equal(pool.buffer[[0, 2, 4]], before[[0, 2, 4]])
    pool.poison([])
    with pytest.raises(IndexError):
        pool.poison([5])


def test_mismatch_names_both_values():
    a = KVLayout(4, 2, 64, 16, "float32")
    b = KVLayout(4, 2, 64, 32, "bfloat16")
    with pytest.raises(LayoutMismatch) as err:
        a.check_compatible(b, mine="decode", theirs="prefill")
    msg = str(err.value)
    assert "page_size: 16 vs 32" in msg and "dtype: float32 vs bfloat16" in msg
    assert KVLayout.from_dict(a.to_dict()) == a


def test_coalesce_merges_runs_consecutive_on_both_sides():
    runs = coalesce([3, 4, 5, 9, 10, 2], [7, 8, 9, 1, 3, 4])
    assert runs == [PageRun(3, 7, 3), PageRun(9, 1, 1), PageRun(10, 3, 1), PageRun(2, 4, 1)]
    with pytest.raises(ValueError):
        coalesce([1], [])
