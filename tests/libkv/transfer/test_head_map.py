"""The KV-head map between TP sizes: exact slices and byte pieces, and the layouts it refuses."""

from __future__ import annotations

import pytest
import torch

from libkv.layout import KVLayout, LayoutMismatch
from libkv.pool import KVPool
from libkv.transfer.head_map import HeadSlice, check_mappable, head_slices, slice_regions


def test_slices_between_sizes():
    assert head_slices(4, 1, 2, 0) == [HeadSlice(0, 0, 0, 2), HeadSlice(1, 2, 0, 2)]
    assert head_slices(4, 2, 1, 1) == [HeadSlice(0, 0, 2, 2)]
    assert head_slices(4, 2, 4, 1) == [HeadSlice(2, 0, 0, 1), HeadSlice(3, 1, 0, 1)]
    assert head_slices(4, 2, 2, 1) == [HeadSlice(1, 0, 0, 2)]


@pytest.mark.parametrize(("heads", "sender", "receiver"), [(6, 2, 3), (6, 3, 2), (2, 4, 1)])
def test_unmappable_sizes_are_refused_naming_both(heads, sender, receiver):
    with pytest.raises(LayoutMismatch,
                       match=f"--tp-size {sender} \\(prefill\\) and --tp-size {receiver} \\(decode\\)"):
        check_mappable(heads, sender, receiver)


def test_regions_move_exactly_the_shared_heads():
    # A 1-rank pool of 4 heads split onto 2 ranks of 2 heads: copying the regions byte for byte
    # must give each rank's page the heads it owns, for every layer, K/V and slot.
    full = KVLayout(num_layers=2, num_kv_heads=4, head_dim=3, page_size=2, dtype="float32")
    half = KVLayout(num_layers=2, num_kv_heads=2, head_dim=3, page_size=2, dtype="float32")
    source = KVPool(full, 3)
    source.buffer.copy_(torch.arange(source.buffer.numel(), dtype=torch.float32).view_as(source.buffer))
    for rank in (0, 1):
        target = KVPool(half, 4)
        [cut] = [c for c in head_slices(4, 1, 2, 0) if c.dst_rank == rank]
        src_bytes, dst_bytes = source.as_bytes(), target.as_bytes()
        for region in slice_regions(cut, [2], [3], full, half):
            dst_bytes[region.dst:region.dst + region.nbytes] = \
                src_bytes[region.src:region.src + region.nbytes]
        assert torch.equal(target.buffer[3], source.buffer[2][..., 2 * rank:2 * rank + 2, :])
        assert target.buffer[:3].abs().sum() == 0  # nothing outside the destination page


def test_head_part_checksums_do_not_depend_on_the_split():
    full = KVLayout(num_layers=2, num_kv_heads=4, head_dim=3, page_size=2, dtype="float32")
    half = KVLayout(num_layers=2, num_kv_heads=2, head_dim=3, page_size=2, dtype="float32")
    whole = KVPool(full, 2)
    whole.buffer.normal_()
    ranks = [KVPool(half, 2) for _ in range(2)]
    for rank, pool in enumerate(ranks):
        pool.buffer.copy_(whole.buffer[..., 2 * rank:2 * rank + 2, :])
    assert whole.head_part_checksums([1], 4)[0] == ranks[0].head_part_checksums([1], 2)[0] + \
        ranks[1].head_part_checksums([1], 2)[0]
    assert ranks[0].head_part_checksums([1], 1)[0] == ranks[0].page_checksums([1])  # one part: the page
