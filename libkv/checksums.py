"""Page checksums that both sides of a transfer agree on, whatever their tensor-parallel sizes.

A page's checksum is xxh3_64 of its bytes (KVPool.page_checksums). On a TP worker a page is split
by KV head over its ranks' pools: its checksum there (`TPKVPool`) is the xxh3 of its ranks'
checksums in rank order, so decode's landing check (libkv.landing) covers every rank's copy of the
page. Between different sizes both sides compute it over n = max(sizes) equal KV-head parts
instead (`checksums_in_parts`): every rank of either side holds whole parts
(libkv.transfer.head_map requires the larger size to be a multiple of the smaller), so no page is
ever gathered in one process.
"""

from __future__ import annotations

import torch
import xxhash

from libkv.layout import KVLayout
from libkv.pool import KVPool
from libkv.rank_channel import RankChannel


def combine_checksums(per_rank: list[list[int]]) -> list[int]:
    """One checksum per page from each rank's checksum of its part of the page (rank order)."""
    return [_combine(digests) for digests in zip(*per_rank, strict=True)]


def _combine(digests) -> int:
    return xxhash.xxh3_64_intdigest(b"".join(d.to_bytes(8, "little") for d in digests))


class TPKVPool(KVPool):
    """Rank 0's pool of a TP worker: its own heads, with checksums (and poison) that cover every
    rank's heads. `followers` reach ranks 1..N-1, each served by a RankTransfer on its own pool."""

    def __init__(self, layout: KVLayout, num_pages: int, device: str | torch.device,
                 followers: list[RankChannel]) -> None:
        super().__init__(layout, num_pages, device)
        self.followers = followers

    @property
    def tp_size(self) -> int:
        return len(self.followers) + 1

    def page_checksums(self, page_ids: list[int]) -> list[int]:
        mine = super().page_checksums(page_ids)
        return combine_checksums([mine, *(f.call("page_checksums", list(page_ids)) for f in self.followers)])

    def poison(self, page_ids: list[int]) -> None:
        super().poison(page_ids)
        for follower in self.followers:
            follower.call("poison", list(page_ids))

    def part_checksums(self, page_ids: list[int], parts: int) -> list[list[int]]:
        """Per page, the checksums of `parts` equal KV-head parts of the whole model's page."""
        per_rank = parts // self.tp_size
        ranks = [self.head_part_checksums(page_ids, per_rank),
                 *(f.call("head_part_checksums", list(page_ids), per_rank) for f in self.followers)]
        return [[d for rank in ranks for d in rank[k]] for k in range(len(page_ids))]


def checksums_in_parts(pool: KVPool, page_ids: list[int], peer_tp_size: int) -> list[int]:
    """Page checksums as agreed with a peer of TP `peer_tp_size` (see the module doc): the pool's own
    when the sizes are equal, else over max(sizes) KV-head parts. `pool` is the worker's: rank 0's
    TPKVPool on a TP worker."""
    size = pool.tp_size if isinstance(pool, TPKVPool) else 1
    parts = max(size, peer_tp_size)
    if parts == size:
        return pool.page_checksums(page_ids)
    if isinstance(pool, TPKVPool):
        return [_combine(d) for d in pool.part_checksums(page_ids, parts)]
    return [_combine(d) for d in pool.head_part_checksums(page_ids, parts)]
