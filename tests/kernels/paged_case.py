"""Builds small paged-KV scenarios with a dense (unpaged) copy of the same K/V to check against.

Shared by the in-process torch tests and the Triton interpreter checks (tests/kernels/triton_checks.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedCase:
    """A pool holding `len(seq_lens)` sequences on shuffled pages, plus each one's dense K/V."""

    buffer: torch.Tensor           # [num_pages, L, 2, P, Hkv, D]
    page_table: torch.Tensor       # [B, max_pages], unused entries filled with `filler`
    seq_lens: torch.Tensor         # [B]
    dense_k: list[torch.Tensor]    # per layer, per sequence: [len, Hkv, D] (index [layer][b])
    dense_v: list[torch.Tensor]
    q: torch.Tensor                # [B, Hq, D]
    page_ids: list[list[int]]      # pages of each sequence, in order


def make_case(seq_lens: list[int], *, num_layers: int = 2, page_size: int = 4, num_kv_heads: int = 2,
              num_q_heads: int = 4, head_dim: int = 16, dtype: torch.dtype = torch.float32,
              extra_pages: int = 3, filler: int = 0, seed: int = 0) -> PagedCase:
    """Random K/V for each sequence, written page by page onto a random permutation of pages.

    The pool starts filled with large garbage so a read of a wrong slot shows up in the result.
    Drawn on the CPU (the same numbers everywhere), then moved to torch's default device, so the
    cases run on CUDA under `torch.set_default_device("cuda")` (tests/gpu/test_triton_cuda.py).
    """
    with torch.device("cpu"):
        case = _make_case_on_cpu(seq_lens, num_layers, page_size, num_kv_heads, num_q_heads, head_dim, dtype,
                                 extra_pages, filler, seed)
    device = torch.get_default_device()
    return PagedCase(case.buffer.to(device), case.page_table.to(device), case.seq_lens.to(device),
                     [[t.to(device) for t in layer] for layer in case.dense_k],
                     [[t.to(device) for t in layer] for layer in case.dense_v], case.q.to(device),
                     case.page_ids)


def _make_case_on_cpu(seq_lens, num_layers, page_size, num_kv_heads, num_q_heads, head_dim, dtype,
                      extra_pages, filler, seed) -> PagedCase:
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per_seq) + extra_pages
    buffer = (torch.randn((num_pages, num_layers, 2, page_size, num_kv_heads, head_dim), generator=gen)
              * 100).to(dtype)
    order = torch.randperm(num_pages, generator=gen).tolist()
    page_ids, start = [], 0
    for n_pages in pages_per_seq:
        page_ids.append(order[start:start + n_pages])
        start += n_pages
    max_pages = max(pages_per_seq) + 2  # wider than needed: trailing entries must not be read
    page_table = torch.full((len(seq_lens), max_pages), filler, dtype=torch.int32)
    dense_k: list = [[None] * len(seq_lens) for _ in range(num_layers)]
    dense_v: list = [[None] * len(seq_lens) for _ in range(num_layers)]
    for b, n in enumerate(seq_lens):
        page_table[b, :len(page_ids[b])] = torch.tensor(page_ids[b], dtype=torch.int32)
        for layer in range(num_layers):
            k = torch.randn((n, num_kv_heads, head_dim), generator=gen).to(dtype)
            v = torch.randn((n, num_kv_heads, head_dim), generator=gen).to(dtype)
            for t in range(n):  # written one token at a time, independently of the ops under test
                page, off = page_ids[b][t // page_size], t % page_size
                buffer[page, layer, 0, off] = k[t]
                buffer[page, layer, 1, off] = v[t]
            dense_k[layer][b], dense_v[layer][b] = k, v
    q = torch.randn((len(seq_lens), num_q_heads, head_dim), generator=gen).to(dtype)
    return PagedCase(buffer, page_table, torch.tensor(seq_lens, dtype=torch.int32), dense_k, dense_v,
                     q, page_ids)


def dense_decode_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                           scale: float) -> torch.Tensor:
    """Textbook attention in float64, one sequence at a time, K/V repeated per query head."""
    outs = []
    for b, (k, v) in enumerate(zip(keys, values, strict=True)):
        group = q.shape[1] // k.shape[1]
        k64 = k.double().repeat_interleave(group, dim=1)  # [len, Hq, D]
        v64 = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[b].double(), k64) * scale
        outs.append(torch.einsum("ht,thd->hd", torch.softmax(scores, dim=-1), v64))
    return torch.stack(outs)
