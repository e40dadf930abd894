"""Timing of CPU decode-attention variants (not a test): `python -m tools.bench.decode_attention`.

Shape of a 100M-model decode step: batch 16, seq lens uniform in [100, 700], 12 layers, 12 query /
4 KV heads, head_dim 64, page_size 16, fp32, 2 threads. Prints the median milliseconds of one
whole step (all layers) per variant, and each variant's max error against the shipped version.
The shipped implementation (kernels.torch_ops.paged_decode_attention_torch) is the fastest one.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.torch_ops import paged_decode_attention_torch


def _pages_gather_transpose(q, buffer, layer, page_table, seq_lens, scale):
    """Gather whole pages per layer ([B, len, Hkv, D]), transpose views, batched matmul + softmax."""
    batch, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = buffer.shape[3], buffer.shape[4]
    max_len = int(seq_lens.max())
    num_pages = -(-max_len // page_size)
    ids = page_table[:, :num_pages].long().reshape(-1)
    k = buffer[:, layer, 0].index_select(0, ids).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    v = buffer[:, layer, 1].index_select(0, ids).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    qg = q.view(batch, num_kv_heads, -1, head_dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale
    mask = torch.arange(k.shape[2])[None, :] >= seq_lens.long()[:, None]
    scores.masked_fill_(mask[:, None, None, :], float("-inf"))
    return torch.matmul(scores.softmax(-1), v).reshape(batch, num_q_heads, head_dim)


def _pages_gather_sdpa(q, buffer, layer, page_table, seq_lens, scale):
    """Gather whole pages, hand SDPA strided [B, Hkv, len, D] views and a boolean length mask."""
    batch, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = buffer.shape[3], buffer.shape[4]
    num_pages = -(-int(seq_lens.max()) // page_size)
    ids = page_table[:, :num_pages].long().reshape(-1)
    k = buffer[:, layer, 0].index_select(0, ids).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    v = buffer[:, layer, 1].index_select(0, ids).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    mask = torch.arange(k.shape[2])[None, :] < seq_lens.long()[:, None]
    qg = q.view(batch, num_kv_heads, -1, head_dim)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(batch, num_q_heads, head_dim)


def _row_index(buffer, layer, page_table, seq_lens):
    """Row ids (rows of head_dim values in buffer.view(-1, D)) laid out as [2, B, Hkv, len]."""
    page_size, num_kv_heads, head_dim = buffer.shape[3:]
    num_pages = -(-int(seq_lens.max()) // page_size)
    positions = torch.arange(num_pages * page_size)
    pages = page_table[:, :num_pages].long()[:, positions // page_size]  # [B, len]
    rows_per_page = buffer.stride(0) // head_dim
    token_rows = (pages * rows_per_page + (positions % page_size) * num_kv_heads
                  + layer * (buffer.stride(1) // head_dim))
    rows = token_rows[:, None, :] + torch.arange(num_kv_heads)[None, :, None]  # [B, Hkv, len]
    return torch.stack([rows, rows + buffer.stride(2) // head_dim])


def _rows_gather_matmul(q, buffer, layer, page_table, seq_lens, scale):
    """Gather head_dim-sized rows straight into [B, Hkv, len, D] (one copy), then matmul + softmax."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = buffer.shape[4]
    rows = _row_index(buffer, layer, page_table, seq_lens)
    kv = buffer.view(-1, head_dim).index_select(0, rows.view(-1)).view(2, batch, num_kv_heads, -1, head_dim)
    qg = q.view(batch, num_kv_heads, -1, head_dim)
    scores = torch.matmul(qg, kv[0].transpose(-1, -2)) * scale
    mask = torch.arange(kv.shape[3])[None, :] >= seq_lens.long()[:, None]
    scores.masked_fill_(mask[:, None, None, :], float("-inf"))
    return torch.matmul(scores.softmax(-1), kv[1]).reshape(batch, num_q_heads, head_dim)


def _rows_gather_sdpa(q, buffer, layer, page_table, seq_lens, scale):
    """Row gather into [B, Hkv, len, D], then SDPA with a boolean mask."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = buffer.shape[4]
    rows = _row_index(buffer, layer, page_table, seq_lens)
    kv = buffer.view(-1, head_dim).index_select(0, rows.view(-1)).view(2, batch, num_kv_heads, -1, head_dim)
    mask = torch.arange(kv.shape[3])[None, :] < seq_lens.long()[:, None]
    qg = q.view(batch, num_kv_heads, -1, head_dim)
    out = F.scaled_dot_product_attention(qg, kv[0], kv[1], attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(batch, num_q_heads, head_dim)


def _per_sequence_sdpa(q, buffer, layer, page_table, seq_lens, scale):
    """No padding: a Python loop over the batch, each sequence gathered and attended on its own."""
    batch, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = buffer.shape[3], buffer.shape[4]
    out = torch.empty_like(q)
    for b, length in enumerate(seq_lens.tolist()):
        ids = page_table[b, :-(-length // page_size)].long()
        k = buffer[:, layer, 0].index_select(0, ids).view(-1, num_kv_heads, head_dim)[:length]
        v = buffer[:, layer, 1].index_select(0, ids).view(-1, num_kv_heads, head_dim)[:length]
        qg = q[b].view(num_kv_heads, -1, head_dim)
        out[b] = F.scaled_dot_product_attention(qg, k.transpose(0, 1), v.transpose(0, 1),
                                                scale=scale).reshape(num_q_heads, head_dim)
    return out


def _ragged_rows_sdpa(q, buffer, layer, page_table, seq_lens, scale):
    """One row gather of every sequence's real tokens (no padding) into [2, Hkv, total, D], then a
    loop over the batch running SDPA on each sequence's slice (a view, no copy)."""
    batch, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = buffer.shape[3], buffer.shape[4]
    lens = seq_lens.long()
    total = int(lens.sum())
    starts = torch.cumsum(lens, 0) - lens
    seq_of_token = torch.repeat_interleave(torch.arange(batch), lens, output_size=total)
    pos = torch.arange(total) - starts[seq_of_token]
    pages = page_table.long()[seq_of_token, pos // page_size]
    token_rows = (pages * (buffer.stride(0) // head_dim) + (pos % page_size) * num_kv_heads
                  + layer * (buffer.stride(1) // head_dim))
    rows = token_rows[None, :] + torch.arange(num_kv_heads)[:, None]  # [Hkv, total]
    rows = torch.stack([rows, rows + buffer.stride(2) // head_dim])
    kv = buffer.view(-1, head_dim).index_select(0, rows.view(-1)).view(2, num_kv_heads, total, head_dim)
    out = torch.empty_like(q)
    qg = q.view(batch, num_kv_heads, -1, head_dim)
    for b, (start, length) in enumerate(zip(starts.tolist(), lens.tolist(), strict=True)):
        span = slice(start, start + length)
        out[b] = F.scaled_dot_product_attention(qg[b], kv[0, :, span], kv[1, :, span],
                                                scale=scale).view(num_q_heads, head_dim)
    return out


def _ragged_rows_matmul(q, buffer, layer, page_table, seq_lens, scale):
    """As _ragged_rows_sdpa but with matmul + softmax per sequence instead of SDPA."""
    batch, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = buffer.shape[3], buffer.shape[4]
    lens = seq_lens.long()
    total = int(lens.sum())
    starts = torch.cumsum(lens, 0) - lens
    seq_of_token = torch.repeat_interleave(torch.arange(batch), lens, output_size=total)
    pos = torch.arange(total) - starts[seq_of_token]
    pages = page_table.long()[seq_of_token, pos // page_size]
    token_rows = (pages * (buffer.stride(0) // head_dim) + (pos % page_size) * num_kv_heads
                  + layer * (buffer.stride(1) // head_dim))
    rows = token_rows[None, :] + torch.arange(num_kv_heads)[:, None]
    rows = torch.stack([rows, rows + buffer.stride(2) // head_dim])
    kv = buffer.view(-1, head_dim).index_select(0, rows.view(-1)).view(2, num_kv_heads, total, head_dim)
    out = torch.empty_like(q)
    qg = q.view(batch, num_kv_heads, -1, head_dim)
    for b, (start, length) in enumerate(zip(starts.tolist(), lens.tolist(), strict=True)):
        span = slice(start, start + length)
        probs = torch.softmax(torch.matmul(qg[b], kv[0, :, span].transpose(-1, -2)) * scale, -1)
        out[b] = torch.matmul(probs, kv[1, :, span]).view(num_q_heads, head_dim)
    return out


def _ragged_pages(buffer, layer, page_table, seq_lens):
    """K and V ([pages*P, Hkv, D] each) of every sequence's used pages back to back, and the row
    where each sequence starts."""
    page_size, num_kv_heads, head_dim = buffer.shape[3:]
    lens = seq_lens.long()
    pages_used = (lens + page_size - 1) // page_size
    in_use = torch.arange(page_table.shape[1])[None, :] < pages_used[:, None]
    ids = page_table.long()[in_use]
    k = buffer[:, layer, 0].index_select(0, ids).view(-1, num_kv_heads, head_dim)
    v = buffer[:, layer, 1].index_select(0, ids).view(-1, num_kv_heads, head_dim)
    starts = (torch.cumsum(pages_used, 0) - pages_used) * page_size
    return k, v, starts.tolist(), lens.tolist()


def _ragged_pages_sdpa(q, buffer, layer, page_table, seq_lens, scale):
    """One page gather (no padding beyond the last page) per K and V; loop SDPA on strided views."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = buffer.shape[4]
    k, v, starts, lens = _ragged_pages(buffer, layer, page_table, seq_lens)
    out = torch.empty_like(q)
    qg = q.view(batch, num_kv_heads, -1, head_dim)
    for b, (start, length) in enumerate(zip(starts, lens, strict=True)):
        span = slice(start, start + length)
        out[b] = F.scaled_dot_product_attention(qg[b], k[span].transpose(0, 1), v[span].transpose(0, 1),
                                                scale=scale).view(num_q_heads, head_dim)
    return out


def _ragged_pages_matmul(q, buffer, layer, page_table, seq_lens, scale):
    """The shipped algorithm, but selecting pages from the strided layer view (the slower copy)."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = buffer.shape[4]
    k, v, starts, lens = _ragged_pages(buffer, layer, page_table, seq_lens)
    out = torch.empty_like(q)
    qg = q.view(batch, num_kv_heads, -1, head_dim) * scale
    for b, (start, length) in enumerate(zip(starts, lens, strict=True)):
        span = slice(start, start + length)
        probs = torch.softmax(torch.matmul(qg[b], k[span].permute(1, 2, 0)), -1)
        out[b] = torch.matmul(probs, v[span].transpose(0, 1)).view(num_q_heads, head_dim)
    return out


VARIANTS: dict[str, Callable] = {
    "shipped: ragged pages + loop matmul": paged_decode_attention_torch,
    "pages gather + transpose + matmul": _pages_gather_transpose,
    "pages gather + SDPA (strided)": _pages_gather_sdpa,
    "rows gather + matmul": _rows_gather_matmul,
    "rows gather + SDPA": _rows_gather_sdpa,
    "per-sequence loop + SDPA": _per_sequence_sdpa,
    "ragged rows gather + loop SDPA": _ragged_rows_sdpa,
    "ragged rows gather + loop matmul": _ragged_rows_matmul,
    "ragged pages gather + loop SDPA": _ragged_pages_sdpa,
    "ragged pages (strided select) + matmul": _ragged_pages_matmul,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=700)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--q-heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)

    seq_lens = torch.randint(args.min_len, args.max_len + 1, (args.batch,), generator=gen, dtype=torch.int32)
    pages_per_seq = [-(-int(n) // args.page_size) for n in seq_lens]
    num_pages = sum(pages_per_seq) + 64
    buffer = torch.randn(num_pages, args.layers, 2, args.page_size, args.kv_heads, args.head_dim,
                         generator=gen)
    order = torch.randperm(num_pages, generator=gen)
    page_table = torch.zeros(args.batch, max(pages_per_seq), dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages_per_seq):
        page_table[b, :n] = order[start:start + n]
        start += n
    q = torch.randn(args.batch, args.q_heads, args.head_dim, generator=gen)
    scale = args.head_dim ** -0.5

    want = paged_decode_attention_torch(q, buffer, 0, page_table, seq_lens, scale)
    print(f"batch {args.batch}, lens {args.min_len}-{args.max_len} (mean {seq_lens.float().mean():.0f}), "
          f"{args.layers} layers, {args.q_heads}/{args.kv_heads} heads, dim {args.head_dim}, "
          f"page {args.page_size}, {torch.get_num_threads()} threads")
    errors = {name: (fn(q, buffer, 0, page_table, seq_lens, scale) - want).abs().max().item()
              for name, fn in VARIANTS.items()}
    # Round-robin over the variants so a burst of load from other processes hits all of them.
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):
        for name, fn in VARIANTS.items():
            begin = time.perf_counter()
            for layer in range(args.layers):
                fn(q, buffer, layer, page_table, seq_lens, scale)
            times[name].append((time.perf_counter() - begin) * 1e3)
    for name, samples in times.items():
        print(f"{name:36s} {statistics.median(samples):7.2f} ms/step  (min {min(samples):6.2f})  "
              f"max err {errors[name]:.1e}")

if __name__ == "__main__":
    main()
