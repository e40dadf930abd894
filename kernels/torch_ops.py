"""Torch implementations of the KV-cache ops: the CPU path and the reference the Triton kernels match.

All ops address the page-major pool of libkv.pool: `buffer[page, layer, k_or_v, offset, kv_head, dim]`.
A token's slot is `page * page_size + offset`. Every op here is vectorized over tokens and pages
(no Python loop per token), because on CPU these functions are the serving path, not just a check.
"""

from __future__ import annotations

import torch


def _page_size(buffer: torch.Tensor) -> int:
    return buffer.shape[3]


def _token_rows(buffer: torch.Tensor) -> torch.Tensor:
    """The pool as rows of one token's Hkv * D values: row r starts at element r * Hkv * D."""
    return buffer.view(-1, buffer.shape[4] * buffer.shape[5])


def _select_blocks(buffer: torch.Tensor, page_ids: torch.Tensor, layer: int, k_or_v: int) -> torch.Tensor:
    """K (k_or_v=0) or V (1) of `layer` in pages `page_ids`: a contiguous [n, P, Hkv, D] copy.

    Selecting rows of a 2-d view in which each (page, layer, k_or_v) block is one row took about
    half the time of index_select on the strided [num_pages, P, Hkv, D] layer view (2 CPU threads).
    """
    page_size, num_kv_heads, head_dim = buffer.shape[3:]
    blocks = buffer.view(-1, page_size * num_kv_heads * head_dim)
    block_ids = page_ids * (buffer.stride(0) // buffer.stride(2)) + (2 * layer + k_or_v)
    return blocks.index_select(0, block_ids).view(-1, page_size, num_kv_heads, head_dim)


def store_kv_torch(buffer: torch.Tensor, layer: int, slots: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor) -> None:
    """Write K/V of T tokens ([T, Hkv, D] each) into `slots` ([T]) of `layer`.

    Each token's K (and V) is one contiguous row of the pool, so the write is an index_copy_ of
    rows into a flat view. Same cost as index_put_ with (page, offset) pairs on one thread, but
    index_copy_ of a decode batch's few rows stays on the calling thread, while index_put_ always
    opens a parallel region: with several processes sharing 2 cores, waking the second OpenMP
    thread cost 4-25 ms per call in measurements here.
    """
    page_size = _page_size(buffer)
    rows_per_page = buffer.stride(0) // buffer.stride(3)
    rows_per_layer = buffer.stride(1) // buffer.stride(3)
    rows_k_to_v = buffer.stride(2) // buffer.stride(3)
    slots = slots.to(device=buffer.device, dtype=torch.long)
    pages = torch.div(slots, page_size, rounding_mode="floor")
    k_rows = pages * rows_per_page + (slots - pages * page_size) + layer * rows_per_layer
    flat = _token_rows(buffer)
    flat.index_copy_(0, k_rows, k.reshape(len(slots), -1).to(buffer.dtype))
    flat.index_copy_(0, k_rows + rows_k_to_v, v.reshape(len(slots), -1).to(buffer.dtype))


def gather_kv_torch(buffer: torch.Tensor, layer: int, page_ids: torch.Tensor,
                    num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ([num_tokens, Hkv, D], contiguous) of the first `num_tokens` tokens stored in `page_ids`."""
    page_size, num_kv_heads, head_dim = buffer.shape[3:]
    num_pages = -(-num_tokens // page_size)
    if num_pages > len(page_ids):
        raise ValueError(f"{num_tokens} tokens need {num_pages} pages, got {len(page_ids)} page ids")
    ids = page_ids[:num_pages].to(device=buffer.device, dtype=torch.long)
    # The selected blocks are a fresh contiguous tensor; slicing its leading dimension keeps it so.
    k = _select_blocks(buffer, ids, layer, 0).view(-1, num_kv_heads, head_dim)[:num_tokens]
    v = _select_blocks(buffer, ids, layer, 1).view(-1, num_kv_heads, head_dim)[:num_tokens]
    return k, v


def gather_pages_torch(buffer: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """A contiguous copy [n, L, 2, P, Hkv, D] of whole pages `page_ids`, in that order."""
    return buffer.index_select(0, page_ids.to(device=buffer.device, dtype=torch.long))


def scatter_pages_torch(buffer: torch.Tensor, page_ids: torch.Tensor, src: torch.Tensor) -> None:
    """The inverse of gather_pages: write src[i] (a whole page) into page page_ids[i]."""
    ids = page_ids.to(device=buffer.device, dtype=torch.long)
    if src.shape != (len(ids), *buffer.shape[1:]):
        raise ValueError(f"src shape {tuple(src.shape)} does not match {len(ids)} pages of "
                         f"{tuple(buffer.shape[1:])}")
    buffer.index_copy_(0, ids, src.to(device=buffer.device, dtype=buffer.dtype))


def paged_decode_attention_torch(q: torch.Tensor, buffer: torch.Tensor, layer: int,
                                 page_table: torch.Tensor, seq_lens: torch.Tensor,
                                 scale: float) -> torch.Tensor:
    """One query token per sequence attending to its first seq_lens[b] cached tokens.

    q: [B, Hq, D]; page_table: [B, max_pages] page ids (entries past a sequence's last page are
    never read, so they may hold anything); seq_lens: [B]. Query head h reads KV head
    h // (Hq // Hkv). Scores and softmax are computed in fp32; the result has q's dtype. A
    sequence of length 0 gets a zero output.

    How (the fastest of the variants timed in tools/bench/decode_attention.py on 2 CPU threads):
    one index_select per K and V copies the used pages of all sequences back to back (no padding
    to the longest sequence; whole 16-token pages are contiguous chunks, so the copy runs at
    memcpy speed). Then a short loop over the batch runs two small matmuls per sequence on strided
    views of that copy: [Hkv, group, D] x [Hkv, D, len], where the `group` query heads sharing a
    KV head are the rows of one matmul, so K/V are never repeated for GQA and never transposed
    in memory.
    """
    batch, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = buffer.shape[3], buffer.shape[4]
    group = num_q_heads // num_kv_heads
    compute_dtype = torch.float32
    lens = seq_lens.to(device=buffer.device, dtype=torch.long)
    pages_used = torch.div(lens + page_size - 1, page_size, rounding_mode="floor")
    max_pages = int(pages_used.max()) if batch else 0
    in_use = torch.arange(max_pages, device=buffer.device)[None, :] < pages_used[:, None]
    ids = page_table[:, :max_pages].to(device=buffer.device, dtype=torch.long)[in_use]
    k = _select_blocks(buffer, ids, layer, 0).view(-1, num_kv_heads, head_dim).to(compute_dtype)
    v = _select_blocks(buffer, ids, layer, 1).view(-1, num_kv_heads, head_dim).to(compute_dtype)
    row_starts = ((torch.cumsum(pages_used, 0) - pages_used) * page_size).tolist()

    q_scaled = (q.to(compute_dtype) * scale).reshape(batch, num_kv_heads, group, head_dim)
    out = torch.empty((batch, num_kv_heads, group, head_dim), dtype=compute_dtype, device=q.device)
    for b, (start, length) in enumerate(zip(row_starts, lens.tolist(), strict=True)):
        rows = slice(start, start + length)
        # A zero-length sequence gives an empty softmax and a zero product: a zero output.
        probs = torch.softmax(torch.matmul(q_scaled[b], k[rows].permute(1, 2, 0)), dim=-1)
        torch.matmul(probs, v[rows].transpose(0, 1), out=out[b])
    return out.view(batch, num_q_heads, head_dim).to(q.dtype)
