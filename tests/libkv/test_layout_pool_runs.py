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


MLA = KVLayout.mla(num_layers=3, kv_lora_rank=6, qk_rope_head_dim=2, page_size=4, dtype="bfloat16")


def test_an_mla_pool_holds_one_latent_row_per_token_and_layer():
    assert MLA.page_shape == (3, 1, 4, 1, 8) and MLA.page_nbytes == 3 * 4 * 8 * 2
    pool = KVPool(MLA, num_pages=3)
    pool.latent_cache(2)[1].fill_(1.0)
    assert pool.latent_cache(2).shape == (3, 4, 1, 8)
    block = pool.buffer[1].view(-1)  # page-major: the layer's rows lie inside page 1
    assert block.sum().item() == 4 * 8 and pool.buffer[[0, 2]].abs().sum() == 0
    with pytest.raises(ValueError, match="no V"):
        pool.v_cache(0)
    with pytest.raises(ValueError, match="latent_cache is an MLA pool's"):
        KVPool(KVLayout(2, 2, 4, 4, "float32"), 1).latent_cache(0)
    pool.poison([2])
    assert pool.buffer[2].isnan().all() and not pool.buffer[:2].isnan().any()


def test_an_mla_page_is_checksummed_whole():
    pool = KVPool(MLA, num_pages=2)
    pool.buffer.normal_(generator=torch.Generator().manual_seed(0))
    assert pool.head_part_checksums([1, 0], 1) == [[c] for c in pool.page_checksums([1, 0])]
    with pytest.raises(ValueError, match="no KV heads to split into 2 parts"):
        pool.head_part_checksums([1], 2)


def test_layouts_travel_as_dicts_and_a_gqa_one_reads_as_before_mla():
    gqa = KVLayout(4, 2, 64, 16, "float32")
    assert gqa.to_dict() == {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64, "page_size": 16,
                             "dtype": "float32"}
    assert KVLayout.from_dict(gqa.to_dict()) == gqa and KVLayout.from_dict(MLA.to_dict()) == MLA
    assert MLA.to_dict()["kv_lora_rank"] == 6 and MLA.to_dict()["qk_rope_head_dim"] == 2


def test_an_mla_mismatch_names_the_latent_fields():
    other = KVLayout.mla(num_layers=3, kv_lora_rank=4, qk_rope_head_dim=4, page_size=4, dtype="bfloat16")
    with pytest.raises(LayoutMismatch) as err:
        MLA.check_compatible(other, mine="prefill", theirs="decode")
    msg = str(err.value)
    # head_dim (latent + rope) is 8 on both: only the two latent fields differ
    assert msg.startswith("KV layout mismatch (prefill vs decode): kv_lora_rank: 6 vs 4; "
                          "qk_rope_head_dim: 2 vs 4 [")
    assert "[prefill: layers=3 mla kv_lora_rank=6 qk_rope_head_dim=2 page_size=4 dtype=bfloat16]" in msg
    with pytest.raises(LayoutMismatch, match="num_kv_heads: 1 vs 2; head_dim: 8 vs 4; kv_lora_rank: 6 vs 0"):
        MLA.check_compatible(KVLayout(3, 2, 4, 4, "bfloat16"))


def test_coalesce_merges_runs_consecutive_on_both_sides():
    runs = coalesce([3, 4, 5, 9, 10, 2], [7, 8, 9, 1, 3, 4])
    assert runs == [PageRun(3, 7, 3), PageRun(9, 1, 1), PageRun(10, 3, 1), PageRun(2, 4, 1)]
    with pytest.raises(ValueError):
        coalesce([1], [])
