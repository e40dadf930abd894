"""Torch implementations of the KV-cache ops: the CPU path and the reference the Triton kernels match.

All ops address the page-major pool of libkv.pool: `buffer[page, layer, k_or_v, offset, kv_head, dim]`.
A token's slot is `page * page_size + offset`. Every op here is vectorized over tokens and pages
(no Python loop per token), because on CPU these functions are the serving path, not just a check.
"""

from __future__ import annotations

import torch


def _page_size(buffer: torch.Tensor) -> int:
    return buffer.shape[3]


def store_kv_torch(buffer: torch.Tensor, layer: int, slots: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor) -> None:
    """Write K/V of T tokens ([T, Hkv, D] each) into `slots` ([T]) of `layer`."""
    page_size = _page_size(buffer)
    slots = slots.to(device=buffer.device, dtype=torch.long)
    pages = torch.div(slots, page_size, rounding_mode="floor")
    offsets = slots - pages * page_size
    # Index the [num_pages, page_size, Hkv, D] views with (page, offset) pairs: one index_put each.
    buffer[:, layer, 0].index_put_((pages, offsets), k.to(buffer.dtype))
    buffer[:, layer, 1].index_put_((pages, offsets), v.to(buffer.dtype))


def gather_kv_torch(buffer: torch.Tensor, layer: int, page_ids: torch.Tensor,
                    num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ([num_tokens, Hkv, D], contiguous) of the first `num_tokens` tokens stored in `page_ids`."""
    page_size, num_kv_heads, head_dim = buffer.shape[3:]
    num_pages = -(-num_tokens // page_size)
    if num_pages > len(page_ids):
        raise ValueError(f"{num_tokens} tokens need {num_pages} pages, got {len(page_ids)} page ids")
    ids = page_ids[:num_pages].to(device=buffer.device, dtype=torch.long)
    # index_select on the strided layer view returns a fresh contiguous tensor; slicing its leading
    # dimension keeps it contiguous.
    k = buffer[:, layer, 0].index_select(0, ids).view(-1, num_kv_heads, head_dim)[:num_tokens]
    v = buffer[:, layer, 1].index_select(0, ids).view(-1, num_kv_heads, head_dim)[:num_tokens]
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
    never read); seq_lens: [B]. Query head h reads KV head h // (Hq // Hkv). Scores and softmax
    are computed in fp32; the result has q's dtype. A sequence of length 0 gets a zero output.

    The pages of every sequence are gathered once into a padded [B, max_len, Hkv, D] tensor and
    attended with a length mask: for decode-sized batches one batched matmul over the padding
    is cheaper than a Python loop of per-sequence matmuls.
    """
    batch, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = buffer.shape[3], buffer.shape[4]
    group = num_q_heads // num_kv_heads
    lens = seq_lens.to(device=buffer.device, dtype=torch.long)
    max_len = int(lens.max()) if batch else 0
    num_pages = max(-(-max_len // page_size), 1)

    # Entries past a sequence's last page may hold anything (even out-of-range ids): point them at
    # page 0 so the gather stays in bounds; the length mask hides whatever they hold.
    table = page_table[:, :num_pages].to(device=buffer.device, dtype=torch.long)
    pages_used = torch.div(lens + page_size - 1, page_size, rounding_mode="floor")
    in_use = torch.arange(num_pages, device=buffer.device) < pages_used[:, None]
    ids = torch.where(in_use, table, 0).view(-1)

    padded_len = num_pages * page_size
    compute_dtype = torch.float32
    # [B, Hkv, len, D]: the gather copies anyway, so pay for the transposition during it.
    k = buffer[:, layer, 0].index_select(0, ids).view(batch, padded_len, num_kv_heads, head_dim)
    v = buffer[:, layer, 1].index_select(0, ids).view(batch, padded_len, num_kv_heads, head_dim)
    k = k.to(compute_dtype).transpose(1, 2)
    v = v.to(compute_dtype).transpose(1, 2)

    # GQA without repeating K/V: the `group` query heads of one KV head share its K/V rows.
    qg = q.to(compute_dtype).view(batch, num_kv_heads, group, head_dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [B, Hkv, group, len]
    past_end = torch.arange(padded_len, device=buffer.device)[None, :] >= lens[:, None]
    scores.masked_fill_(past_end[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v)  # [B, Hkv, group, D]
    if bool((lens == 0).any()):
        out = torch.where((lens == 0)[:, None, None, None], 0.0, out)
    return out.reshape(batch, num_q_heads, head_dim).to(q.dtype)
