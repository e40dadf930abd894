"""The engine's padded CPU decode path agrees with kernels.ops.paged_decode_attention."""

from __future__ import annotations

import torch

from engine.models.attention import AttentionMetadata, decode_attention, padded_decode
from kernels import ops


def test_padded_decode_matches_kernels_ops():
    generator = torch.Generator().manual_seed(0)
    layers, page_size, kv_heads, q_heads, head_dim = 2, 4, 2, 6, 16
    buffer = torch.randn(40, layers, 2, page_size, kv_heads, head_dim, generator=generator)
    lens = [17, 15, 18, 16]
    pages = torch.randperm(40, generator=generator).tolist()
    tables = [pages[i * 5:(i + 1) * 5] for i in range(4)]
    plan = padded_decode(lens, tables, page_size, torch.device("cpu"))
    assert plan is not None and plan.num_pages == 5
    q = torch.randn(4, q_heads, head_dim, generator=generator)
    meta = AttentionMetadata(slots=torch.zeros(4, dtype=torch.long), num_decode=4, decode_page_table=None,
                             decode_seq_lens=None, extends=[], decode_padded=plan)
    expected = ops.paged_decode_attention(q, buffer, 1, torch.tensor(tables), torch.tensor(lens), 0.25)
    torch.testing.assert_close(decode_attention(q, buffer, 1, meta, 0.25), expected, rtol=1e-5, atol=1e-5)


def test_unequal_lengths_use_kernels_ops():
    assert padded_decode([5, 100], [[0, 1], list(range(2, 27))], 4, torch.device("cpu")) is None
