"""Knowing that a KV write has landed: the page checksums both sides of a transfer agree on, and
the wait until a receiver's pages hash to what the sender sent.

Landing. A transfer engine's "write done" tells the sender it is finished with the write; whether
the bytes are already in the receiver's memory is the engine's business and differs between
engines, transports and versions (Mooncake's TCP transport, as its source reads, completes a write
once the sender's socket took it, and the receiver's transfer thread copies it into the pool
later). Bytes that land after decode reused their pages would corrupt another request's KV
silently. The receiver can see arrival itself, with no help from the engine: prefill checksums
each page right before writing it (xxh3, TransferBackend.page_checksums_for), and once decode's
copy of a page hashes to the same value the page holds exactly what was sent, so nothing still in
flight can change it. That holds only if the page could not match before the write: decode
poisons the pages it offers a one-sided writer (KVPool.poison), since a page reused for the same
prompt can already hold the very bytes on their way. `wait_landed` polls that, bounded: on
success before the request joins the batch, and after an aborted request before its pages are
freed (with the checksums of the writes prefill issued).

Tensor parallelism. A page's checksum is xxh3_64 of its bytes (KVPool.page_checksums). On a TP
worker a page is split by KV head over its ranks' pools: its checksum there (`TPKVPool`) is the
xxh3 of its ranks' checksums in rank order, so the landing check covers every rank's copy of the
page. Between different sizes both sides compute it over n = max(sizes) equal KV-head parts
instead (`checksums_in_parts`): every rank of either side holds whole parts
(libkv.transfer.head_map requires the larger size to be a multiple of the smaller), so no page is
ever gathered in one process.

MLA (KVLayout.is_mla). Every rank holds the whole latent page, and each receiver rank j is written
once, whole, by sender rank j % (sender's size) (libkv.transfer.head_map.latent_receivers). The
receiver checks what it holds: its pool's page checksum, over every rank's copy (xxh3 of the page
at TP 1, of its ranks' page checksums at TP N), whatever the sender's size, so a rank whose bytes
are still on their way keeps the page from matching. The sender computes the same value from the
pages it writes (`sent_checksums`): rank j % size's page for receiver rank j, so at TP 1 against
TP 1 (or several prefill ranks against one decode rank) rank 0's page alone. Sender ranks are never
assumed to hold bit-identical latents: each receiver rank is compared with its own writer's page.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import torch
import xxhash

from libkv.layout import KVLayout
from libkv.pool import KVPool
from libkv.rank_channel import RankChannel

# Bytes a sender has handed to its socket arrive within milliseconds unless this host is starved;
# past this bound a page that still differs was damaged (or its write failed midway), not late.
LANDING_TIMEOUT_S = 10.0
_FIRST_POLL_S = 0.001
_MAX_POLL_S = 0.05


def combine_checksums(per_rank: list[list[int]]) -> list[int]:
    """One checksum per page from each rank's checksum of its part of the page (rank order)."""
    return [_combine(digests) for digests in zip(*per_rank, strict=True)]


def _combine(digests) -> int:
    return xxhash.xxh3_64_intdigest(b"".join(d.to_bytes(8, "little") for d in digests))


class SplitPages:
    """Checksums and poison of pages split over ranks: each rank holds its KV heads of every page (MLA:
    its copy of the whole latent page). A page's checksum is the xxh3 of its ranks' checksums in rank
    order (module doc). Subclasses say how to call each rank (`_each_rank`)."""

    layout: KVLayout

    @property
    def tp_size(self) -> int:
        raise NotImplementedError

    def _each_rank(self, method: str, *args: object, ranks: int | None = None) -> list:
        """`method` (a KVPool method) called on ranks 0..`ranks`-1 (default: all), in rank order."""
        raise NotImplementedError

    def page_checksums(self, page_ids: list[int]) -> list[int]:
        per_rank = self._each_rank("page_checksums", list(page_ids))
        # one rank: the page's own checksum, as a worker of one rank computes it
        return per_rank[0] if len(per_rank) == 1 else combine_checksums(per_rank)

    def poison(self, page_ids: list[int]) -> None:
        self._each_rank("poison", list(page_ids))

    def rank_checksums(self, page_ids: list[int], ranks: int) -> list[list[int]]:
        """Each of ranks 0..`ranks`-1's page checksums of its own pool, in rank order."""
        return self._each_rank("page_checksums", list(page_ids), ranks=ranks)

    def part_checksums(self, page_ids: list[int], parts: int) -> list[list[int]]:
        """Per page, the checksums of `parts` equal KV-head parts of the whole model's page."""
        if self.layout.is_mla:
            raise ValueError("an MLA latent page has no KV heads to split: checksum whole pages")
        ranks = self._each_rank("head_part_checksums", list(page_ids), parts // self.tp_size)
        return [[d for rank in ranks for d in rank[k]] for k in range(len(page_ids))]


class TPKVPool(SplitPages, KVPool):
    """Rank 0's pool of a TP worker: its own heads, with checksums (and poison) that cover every
    rank's heads (MLA: every rank's copy of the latent page). `followers` reach ranks 1..N-1, each
    served by a RankTransfer on its own pool."""

    def __init__(self, layout: KVLayout, num_pages: int, device: str | torch.device,
                 followers: list[RankChannel]) -> None:
        super().__init__(layout, num_pages, device)
        self.followers = followers

    @property
    def tp_size(self) -> int:
        return len(self.followers) + 1

    def _each_rank(self, method: str, *args: object, ranks: int | None = None) -> list:
        others = self.followers if ranks is None else self.followers[:ranks - 1]
        return [getattr(KVPool, method)(self, *args), *(f.call(method, *args) for f in others)]


class RankGroupPool(SplitPages):
    """The pool of a group of ranks none of which is this process (a DP attention group other than
    rank 0's: engine.dp_engine): no memory here, only the checksums and poison of the group's pages,
    through each rank's channel (a RankTransfer serves it). Reads as a TPKVPool of the group's size."""

    def __init__(self, layout: KVLayout, num_pages: int, ranks: list[RankChannel]) -> None:
        if not ranks:
            raise ValueError("a rank group's pool needs at least one rank")
        self.layout, self.num_pages, self.ranks = layout, num_pages, list(ranks)

    @property
    def tp_size(self) -> int:
        return len(self.ranks)

    def _each_rank(self, method: str, *args: object, ranks: int | None = None) -> list:
        return [rank.call(method, *args) for rank in self.ranks[:ranks]]


# Whatever holds a room's pages as decode checks them: a pool in this process (a TP worker's rank-0
# TPKVPool among them), or a DP attention group's ranks seen from rank 0 (RankGroupPool).
LandingPool = KVPool | SplitPages


def checksums_in_parts(pool: LandingPool, page_ids: list[int], peer_tp_size: int) -> list[int]:
    """Page checksums as agreed with a peer of TP `peer_tp_size` (see the module doc): the pool's own
    when the sizes are equal, else over max(sizes) KV-head parts. `pool` is the worker's: rank 0's
    TPKVPool on a TP worker. For MLA this is the receiver's value (the sender's: `sent_checksums`)."""
    size = _tp_size(pool)
    parts = max(size, peer_tp_size)
    if parts == size or pool.layout.is_mla:
        return pool.page_checksums(page_ids)
    split = pool.part_checksums if isinstance(pool, SplitPages) else pool.head_part_checksums
    return [_combine(d) for d in split(page_ids, parts)]


def sent_checksums(pool: KVPool, page_ids: list[int], receiver_tp_size: int) -> list[int]:
    """Checksums of local pages about to be written to a receiver of TP `receiver_tp_size`, as it
    will compute them on arrival (`checksums_in_parts` there; module doc). `pool` is the worker's."""
    if not pool.layout.is_mla:
        return checksums_in_parts(pool, page_ids, receiver_tp_size)
    from libkv.transfer.head_map import latent_writer  # libkv.transfer imports this module

    size = _tp_size(pool)
    if receiver_tp_size == size:
        return pool.page_checksums(page_ids)
    writers = min(size, receiver_tp_size)
    per_rank = pool.rank_checksums(page_ids, writers) if isinstance(pool, SplitPages) \
        else [pool.page_checksums(page_ids)]
    if receiver_tp_size == 1:
        return per_rank[0]
    return combine_checksums([per_rank[latent_writer(rank, size)] for rank in range(receiver_tp_size)])


def _tp_size(pool: LandingPool) -> int:
    return pool.tp_size if isinstance(pool, SplitPages) else 1


async def wait_landed(pool: LandingPool, pages: Sequence[int], sent: Sequence[int],
                      timeout_s: float = LANDING_TIMEOUT_S, sender_tp_size: int = 1) -> list[int]:
    """Wait until every page in `pages` hashes to its checksum in `sent`; return the pages that
    still differ after `timeout_s` (empty: everything landed). `sender_tp_size`: the prefill's
    tensor-parallel size, which decides how a page's checksum splits the KV heads."""
    pages, sent = list(pages), list(sent)
    deadline = time.monotonic() + timeout_s
    delay = _FIRST_POLL_S
    while True:
        arrived = await asyncio.to_thread(checksums_in_parts, pool, pages, sender_tp_size)
        pending = [(page, want) for page, want, got in zip(pages, sent, arrived, strict=True) if want != got]
        if not pending or time.monotonic() >= deadline:
            return [page for page, _ in pending]
        pages, sent = [page for page, _ in pending], [want for _, want in pending]
        await asyncio.sleep(delay)
        delay = min(delay * 2, _MAX_POLL_S)
