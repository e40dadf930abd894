"""Coalescing page lists into runs: one transfer per run of consecutive pages on both sides."""

from __future__ import annotations

from dataclasses import dataclass


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
