"""The C++ extend (prefill) attention kernel against torch SDPA over the same K/V.

The reference is SDPA in fp32 math over the span's K/V (the kernel's inputs upcast, exactly), so
the bounds below are the kernel's own rounding:
- fp32: summation order and the polynomial exp, a few ulp: rtol = atol = 1e-5.
- fp16: computed in fp32 (converted exactly on the copy from the pages), rounded once on output
  (2^-11 relative): rtol = atol = 2e-3.
- bf16: the softmax weights are rounded to bf16 before P @ V (as torch's own flash attention does
  in bf16) and the output is rounded to bf16 (2^-8 relative each): rtol = atol = 2e-2.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from engine.models.attention import (
    AttentionMetadata,
    ExtendSpan,
    extend_attention_torch,
    paged_attention,
)
from engine.models.layer_ops import CpuKernelLayerOps
from kernels import cpu_ext, cpu_kernels
from tests.cpu_isa import cpu_isa  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.skipif(shutil.which(cpu_ext.COMPILER) is None, reason="no C++ compiler"),
              pytest.mark.usefixtures("cpu_isa")]  # once per kernel variant this CPU runs

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
             torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
PAGE_SIZE = 16
# (prefix_len, length): no prefix; L = 1; lengths that are not multiples of the 32-query and
# 64-key blocks; a prefix that ends inside a page; prefixes of several pages and KV blocks.
SPANS = [(0, 1), (0, 77), (0, 130), (5, 1), (13, 50), (48, 100), (200, 70), (300, 1)]


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_kernels.available(), cpu_ext.unavailable_reason()


def make_pool(total: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    """A 2-layer pool of large garbage with one span's K/V on shuffled pages of layer 1.

    Returns (buffer, page_ids, k, v) with k/v [total, Hkv, D]: a read of any wrong slot shows.
    """
    gen = torch.Generator().manual_seed(seed)
    num_pages = -(-total // PAGE_SIZE)
    buffer = (torch.randn(num_pages + 4, 2, 2, PAGE_SIZE, num_kv_heads, head_dim, generator=gen)
              * 100).to(dtype)
    page_ids = torch.randperm(num_pages + 4, generator=gen)[:num_pages].to(torch.int32)
    k = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
    for index, page in enumerate(page_ids.tolist()):
        rows = slice(index * PAGE_SIZE, min(total, (index + 1) * PAGE_SIZE))
        count = rows.stop - rows.start
        buffer[page, 1, 0, :count] = k[rows]
        buffer[page, 1, 1, :count] = v[rows]
    return buffer, page_ids, k, v


def sdpa_fp32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int,
              scale: float) -> torch.Tensor:
    length, total = q.shape[0], k.shape[0]
    mask = torch.arange(total)[None, :] <= torch.arange(length)[:, None] + prefix_len
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None],
                                         v.float().transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_extend_attention_matches_sdpa(dtype, group, head_dim):
    num_kv_heads = 2
    for seed, (prefix_len, length) in enumerate(SPANS):
        buffer, page_ids, k, v = make_pool(prefix_len + length, num_kv_heads, head_dim, dtype, seed)
        q = torch.randn(length, num_kv_heads * group, head_dim,
                        generator=torch.Generator().manual_seed(seed)).to(dtype)
        got = cpu_kernels.extend_attention(q, buffer, 1, page_ids, prefix_len, 0.3)
        assert got.dtype == dtype and got.shape == q.shape and got.is_contiguous()
        torch.testing.assert_close(got.float(), sdpa_fp32(q, k, v, prefix_len, 0.3), **TOLERANCE[dtype],
                                   msg=lambda m, p=prefix_len, n=length: f"prefix {p}, length {n}: {m}")


def test_extend_attention_ignores_page_ids_past_the_span():
    buffer, page_ids, k, v = make_pool(40, 2, 64, torch.float32, 0)
    q = torch.randn(10, 4, 64)
    longer = torch.cat([page_ids, torch.tensor([10_000], dtype=torch.int32)])
    got = cpu_kernels.extend_attention(q, buffer, 1, longer, 30, 0.125)
    torch.testing.assert_close(got, sdpa_fp32(q, k, v, 30, 0.125), **TOLERANCE[torch.float32])


def test_extend_attention_rejects_short_page_ids():
    buffer, page_ids, _, _ = make_pool(40, 2, 64, torch.float32, 0)
    with pytest.raises(RuntimeError, match="needs 3 pages"):
        cpu_kernels.extend_attention(torch.randn(10, 4, 64), buffer, 1, page_ids[:2], 30, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_extend_path_matches_torch_path(dtype):
    # A step with two decode rows and two extend spans (one with a prefix), as the model runner
    # lays it out: CpuKernelLayerOps' extend op against the torch reference the engine keeps for
    # --cpu-kernels off.
    gen = torch.Generator().manual_seed(7)
    buffer = (torch.randn(64, 2, 2, PAGE_SIZE, 2, 64, generator=gen)).to(dtype)
    pages = torch.randperm(64, generator=gen)
    spans = [ExtendSpan(start=2, length=40, prefix_len=0, page_ids=pages[:3]),
             ExtendSpan(start=42, length=25, prefix_len=35, page_ids=pages[3:7])]
    q = torch.randn(67, 6, 64, generator=gen).to(dtype)
    k = torch.empty(67, 2, 64, dtype=dtype)
    v = torch.empty(67, 2, 64, dtype=dtype)
    for span in spans:  # the rows' own K/V are what the pool holds at the span's new positions
        for row in range(span.length):
            position = span.prefix_len + row
            page, slot = span.page_ids[position // PAGE_SIZE], position % PAGE_SIZE
            k[span.start + row], v[span.start + row] = buffer[page, 1, 0, slot], buffer[page, 1, 1, slot]
    meta = AttentionMetadata(slots=torch.zeros(67, dtype=torch.long), num_decode=2,
                             decode_page_table=pages[10:14].view(2, 2).to(torch.int32),
                             decode_seq_lens=torch.tensor([20, 31], dtype=torch.int32), extends=spans)
    fused = CpuKernelLayerOps()
    got = paged_attention(q, k, v, buffer, 1, meta, 0.125, fused.paged_decode_attention,
                          fused.extend_attention)
    want = paged_attention(q, k, v, buffer, 1, meta, 0.125, fused.paged_decode_attention,
                           extend_attention_torch)
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])
    # One span alone takes the no-copy path and still returns a contiguous [T, Hq, D].
    alone = AttentionMetadata(slots=torch.zeros(40, dtype=torch.long), num_decode=0, decode_page_table=None,
                              decode_seq_lens=None, extends=[ExtendSpan(0, 40, 0, pages[:3])])
    got = paged_attention(q[2:42], k[2:42], v[2:42], buffer, 1, alone, 0.125,
                          extend_op=fused.extend_attention)
    assert got.is_contiguous()
    torch.testing.assert_close(got.float(), want[2:42].float(), **TOLERANCE[dtype])


def test_extend_attention_after_a_span_too_long_to_keep_its_copy():
    # 20,000 fp32 tokens of 2 KV heads pack to 20 MB, more than a thread keeps between calls: the
    # copy is freed after the call, and the next call packs into a new one.
    for prefix_len, length in [(20_000, 3), (40, 30)]:
        buffer, page_ids, k, v = make_pool(prefix_len + length, 2, 64, torch.float32, prefix_len)
        q = torch.randn(length, 6, 64, generator=torch.Generator().manual_seed(length))
        got = cpu_kernels.extend_attention(q, buffer, 1, page_ids, prefix_len, 0.125)
        torch.testing.assert_close(got, sdpa_fp32(q, k, v, prefix_len, 0.125), **TOLERANCE[torch.float32])
