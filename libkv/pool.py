"""KVPool: the memory that holds every page of K and V for one worker, and the runs of consecutive
pages it moves as one region each (one transfer per run of pages consecutive on both sides)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import xxhash

from libkv.layout import KVLayout


@dataclass(frozen=True)
class PageRun:
    """`length` pages starting at `src_page` locally and `dst_page` remotely, consecutive on both."""

    src_page: int
    dst_page: int
    length: int


@dataclass(frozen=True)
class ByteRun:
    """`nbytes` bytes at byte offset `src` of the local pool into offset `dst` of the peer's: a piece
    of a page (e.g. some KV heads of one layer's slot, for peers that split heads another way)."""

    src: int
    dst: int
    nbytes: int


def coalesce(src_pages: list[int], dst_pages: list[int]) -> list[PageRun]:
    """Pair src_pages[i] with dst_pages[i] and merge neighbours that are consecutive on both sides."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} destination pages")
    runs: list[PageRun] = []
    for src, dst in zip(src_pages, dst_pages, strict=True):
        last = runs[-1] if runs else None
        if last and src == last.src_page + last.length and dst == last.dst_page + last.length:
            runs[-1] = PageRun(last.src_page, last.dst_page, last.length + 1)
        else:
            runs.append(PageRun(src, dst, 1))
    return runs


class KVPool:
    """Page-major KV storage: `buffer[page, layer, k_or_v, slot, kv_head, head_dim]`.

    Page-major means one page (all layers, K and V) is one contiguous block of
    `layout.page_nbytes` bytes, so a run of consecutive page ids is one contiguous region and
    moves as a single transfer-engine write. Attention reads a layer's K or V through the strided
    views `k_cache(layer)` / `v_cache(layer)` of shape [num_pages, page_size, kv_heads, head_dim].

    An MLA pool (`layout.is_mla`) has one plane per layer, `buffer[page, layer, 0, slot, 0, :]`
    the latent then the rope key: `latent_cache(layer)` reads it; it has no V (v_cache raises)
    and no heads to split (head_part_checksums takes one part only).
    """

    def __init__(self, layout: KVLayout, num_pages: int, device: str | torch.device = "cpu") -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.layout = layout
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.buffer = torch.zeros((num_pages, *layout.page_shape), dtype=layout.torch_dtype,
                                  device=self.device)

    def k_cache(self, layer: int) -> torch.Tensor:
        return self.buffer[:, layer, 0]

    def v_cache(self, layer: int) -> torch.Tensor:
        if self.layout.is_mla:
            raise ValueError("an MLA KV pool holds one latent row per token and no V: "
                             "read latent_cache(layer)")
        return self.buffer[:, layer, 1]

    def latent_cache(self, layer: int) -> torch.Tensor:
        """An MLA layer's rows, [num_pages, page_size, 1, kv_lora_rank + qk_rope_head_dim]: the
        latent in the first kv_lora_rank values, the rope key after it."""
        if not self.layout.is_mla:
            raise ValueError("latent_cache is an MLA pool's; this pool holds K and V per head "
                             "(k_cache, v_cache)")
        return self.buffer[:, layer, 0]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def data_ptr(self) -> int:
        return self.buffer.data_ptr()

    def page_offset(self, page: int) -> int:
        """Byte offset of a page from the start of the buffer."""
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page {page} outside pool of {self.num_pages} pages")
        return page * self.layout.page_nbytes

    def as_bytes(self) -> torch.Tensor:
        """The whole pool as a flat uint8 view (for transfer engines that address bytes)."""
        return self.buffer.view(-1).view(torch.uint8)

    def head_part_checksums(self, page_ids: list[int], parts: int) -> list[list[int]]:
        """For each page, xxh3_64 of each of `parts` equal KV-head ranges of it (the bytes of heads
        [k*h/parts, (k+1)*h/parts) in page order, as if that range were a page of its own).

        Why: peers that split a model's KV heads over different numbers of processes (libkv.landing)
        can both compute these for the heads they hold, without gathering a page in one process.
        An MLA page has no heads to split: one part, its page checksum.
        """
        heads = self.layout.num_kv_heads
        if self.layout.is_mla and parts != 1:
            raise ValueError(f"an MLA latent page has no KV heads to split into {parts} parts: "
                             "checksum whole pages")
        if parts < 1 or heads % parts:
            raise ValueError(f"cannot split {heads} KV heads into {parts} parts")
        width = heads // parts
        pages = self.buffer[torch.tensor(page_ids, dtype=torch.long, device=self.device)]
        result = []
        for page in pages:
            part_bytes = [page[..., k * width:(k + 1) * width, :].contiguous().view(-1)
                          .view(torch.uint8).cpu() for k in range(parts)]
            result.append([xxhash.xxh3_64_intdigest(memoryview(b.numpy())) for b in part_bytes])
        return result

    def page_checksums(self, page_ids: list[int]) -> list[int]:
        """xxh3_64 of each page's bytes, in the order given: the KV integrity check.

        The sender checksums the pages it wrote and the receiver re-checksums the pages that
        arrived; any difference means the transfer (or something else) changed them. xxh3 runs
        at memory speed here (about 30 GB/s, against 7 for zlib.crc32) and its 64 bits make an
        accidental match negligible; it is not a MAC and needs none: the grant check stops
        writers that were not invited, this catches bytes that went wrong on the way.
        """
        page_nbytes = self.layout.page_nbytes
        for page in page_ids:
            if not 0 <= page < self.num_pages:
                raise IndexError(f"page {page} outside pool of {self.num_pages} pages")
        if self.device.type == "cpu":
            pool_bytes = self.as_bytes().numpy().data
            return [xxhash.xxh3_64_intdigest(pool_bytes[p * page_nbytes:(p + 1) * page_nbytes])
                    for p in page_ids]
        # Device memory: gather the pages and hash them on the host (one copy).
        pages = (self.buffer[torch.tensor(page_ids, dtype=torch.long, device=self.device)]
                 .contiguous().view(-1).view(torch.uint8).cpu().numpy().data)
        return [xxhash.xxh3_64_intdigest(pages[i * page_nbytes:(i + 1) * page_nbytes])
                for i in range(len(page_ids))]

    def poison(self, page_ids: list[int]) -> None:
        """Fill pages with 0xFF bytes (a NaN in every float dtype), before they are offered to a
        one-sided writer.

        Why: the landing check (libkv.landing) takes "the page hashes to what the sender
        sent" as proof that the write has landed. A page reused for the same prompt can already
        hold those exact bytes from its previous owner, so the check would pass while the write is
        still on its way, and the page could be freed and handed on before the late bytes land in
        it. No computed K/V is all NaN, so a poisoned page matches only once this write arrived.
        """
        for page in page_ids:
            if not 0 <= page < self.num_pages:
                raise IndexError(f"page {page} outside pool of {self.num_pages} pages")
        pages = self.as_bytes().view(self.num_pages, self.layout.page_nbytes)
        # One fill per run of consecutive pages: a memset (index_fill_ went byte by byte: 17x slower).
        ordered = sorted(set(page_ids))
        for run in coalesce(ordered, ordered):
            pages[run.src_page:run.src_page + run.length].fill_(0xFF)

    @staticmethod
    def num_pages_for_budget(layout: KVLayout, budget_bytes: int) -> int:
        return max(budget_bytes // layout.page_nbytes, 0)
