"""How KV heads map between a prefill and a decode worker with different TP sizes (pure math).

Rank i of a worker with TP a holds global KV heads [i*H/a, (i+1)*H/a). Between TP a and TP b,
sender rank i writes to every receiver rank j whose heads overlap its own, the overlap only:
in each page `[layers, K/V, slot, heads, head_dim]` that is one piece per (layer, K/V, slot), at
the overlap's head offset on each side. The larger size must be a multiple of the smaller, so
each rank of the smaller side holds whole head parts of the larger (what the checksums need).

MLA (KVLayout.is_mla) has no heads to split: every rank of either side holds the whole latent page.
Receiver rank j gets it once, whole, from sender rank j % a (`latent_receivers`); any TP sizes map,
and sender ranks >= b (when a > b) write nothing. Why j % a: each receiver rank has exactly one
writer (a second copy would only double the bytes), the writers are spread over the sender's ranks
(each writes ceil(b/a) or floor(b/a) pages per page), and rank j writes to rank j when a == b, the
same pairing as GQA's whole-page writes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from libkv.layout import KVLayout, LayoutMismatch
from libkv.pool import ByteRun


@dataclass(frozen=True)
class HeadSlice:
    """`num_heads` heads from head `src_head` of the sender rank's page into head `dst_head` of
    receiver rank `dst_rank`'s page (head indices local to each rank)."""

    dst_rank: int
    src_head: int
    dst_head: int
    num_heads: int


def whole_model(rank_layout: KVLayout, tp_size: int) -> KVLayout:
    """The page of the whole model, from the page of one of its `tp_size` ranks (an MLA rank
    holds the whole model's latent page already)."""
    if rank_layout.is_mla:
        return rank_layout
    return replace(rank_layout, num_kv_heads=rank_layout.num_kv_heads * tp_size)


def latent_writer(receiver_rank: int, sender_tp: int) -> int:
    """The one sender rank that writes MLA latent pages to receiver rank `receiver_rank`."""
    return receiver_rank % sender_tp


def latent_receivers(sender_tp: int, receiver_tp: int, sender_rank: int) -> list[int]:
    """The receiver ranks sender rank `sender_rank` writes whole MLA latent pages to (module doc);
    empty for a sender rank no receiver rank is assigned to."""
    return [rank for rank in range(receiver_tp) if latent_writer(rank, sender_tp) == sender_rank]


def check_mappable(num_kv_heads: int, sender_tp: int, receiver_tp: int) -> None:
    """Refuse TP sizes whose head splits cannot be mapped, naming both values."""
    big, small = max(sender_tp, receiver_tp), min(sender_tp, receiver_tp)
    if num_kv_heads % big or big % small:
        raise LayoutMismatch(
            f"cannot map KV heads between --tp-size {sender_tp} (prefill) and --tp-size {receiver_tp} "
            f"(decode) for {num_kv_heads} KV heads: the larger size must divide the KV heads and be a "
            "multiple of the smaller")


def head_slices(num_kv_heads: int, sender_tp: int, receiver_tp: int, sender_rank: int) -> list[HeadSlice]:
    """What sender rank `sender_rank` writes to which receiver rank."""
    check_mappable(num_kv_heads, sender_tp, receiver_tp)
    per_sender, per_receiver = num_kv_heads // sender_tp, num_kv_heads // receiver_tp
    start, end = sender_rank * per_sender, (sender_rank + 1) * per_sender
    slices = []
    for rank in range(receiver_tp):
        low, high = max(start, rank * per_receiver), min(end, (rank + 1) * per_receiver)
        if low < high:
            slices.append(HeadSlice(rank, low - start, low - rank * per_receiver, high - low))
    return slices


def slice_regions(cut: HeadSlice, src_pages: list[int], dst_pages: list[int], src_layout: KVLayout,
                  dst_layout: KVLayout) -> list[ByteRun]:
    """The byte pieces of `cut` for each page pair (src_pages[k] -> dst_pages[k])."""
    unit = src_layout.head_dim * src_layout.itemsize  # bytes of one head of one slot
    blocks = src_layout.num_layers * 2 * src_layout.page_size
    src_stride, dst_stride = src_layout.num_kv_heads * unit, dst_layout.num_kv_heads * unit
    nbytes = cut.num_heads * unit
    regions: list[ByteRun] = []
    for src_page, dst_page in zip(src_pages, dst_pages, strict=True):
        src = src_page * src_layout.page_nbytes + cut.src_head * unit
        dst = dst_page * dst_layout.page_nbytes + cut.dst_head * unit
        regions.extend(ByteRun(src + b * src_stride, dst + b * dst_stride, nbytes) for b in range(blocks))
    return regions


def sender_slices(rank_layout: KVLayout, rank: int, tp_size: int, receiver_layout: KVLayout,
                  receiver_tp: int) -> list[HeadSlice]:
    """What sender rank `rank` of `tp_size` (pages of `rank_layout`) writes to which rank of a
    receiver of `receiver_tp` ranks (pages of `receiver_layout`), after refusing whole-model
    layouts that differ and sizes that do not map, naming both values. GQA only: MLA pages move
    whole (`latent_receivers`)."""
    whole_model(rank_layout, tp_size).check_compatible(whole_model(receiver_layout, receiver_tp),
                                                       mine="prefill", theirs="decode")
    heads = rank_layout.num_kv_heads * tp_size
    check_mappable(heads, tp_size, receiver_tp)
    return head_slices(heads, tp_size, receiver_tp, rank)
