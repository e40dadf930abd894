"""The C++ MLA attention kernel against the torch path it replaces (MLAAttention.attend_torch).

Both compute in fp32 from the same inputs (the pool rows and queries upcast exactly, kv_b_proj's
halves in fp32), so the bounds are the kernel's own rounding:
- fp32: summation order and the polynomial exp, a few ulp: rtol = atol = 1e-5.
- bf16 / fp16: the same fp32 result rounded once to the dtype, so at most a step of it where the
  two fp32 results straddle a rounding boundary (2^-8 relative for bf16, 2^-11 for fp16):
  bf16 rtol = atol = 1e-2, fp16 rtol = atol = 2e-3.
Beyond closeness, a row's output must be the same bits alone as in any batch, and as a decode row
or inside an extend span at the same position (batch invariance).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.models.attention import AttentionMetadata, ExtendSpan
from engine.models.layer_ops import CpuKernelLayerOps, TorchLayerOps
from engine.models.mla import MLAAttention
from engine.models.mla_config import MLAConfig
from kernels import cpu_ext, cpu_kernels
from tests.cpu_isa import cpu_isa  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.skipif(shutil.which(cpu_ext.COMPILER) is None, reason="no C++ compiler"),
              pytest.mark.usefixtures("cpu_isa")]  # once per kernel variant this CPU runs

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
             torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}
PAGE_SIZE = 16
LAYERS, LAYER = 2, 1
# (heads, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim): small-deepseek's shape (all
# multiples of 16), and one whose widths leave vector tails (as the tiny test checkpoints do).
SHAPES = {"small-deepseek": (4, 256, 32, 64, 64), "tails": (3, 48, 8, 24, 40)}
DECODE_LENS = [1, 17, 40, 300]
# (length, prefix_len): no prefix; a prefix ending inside a page; one new token after a long prefix.
SPANS = [(33, 0), (25, 35), (1, 130)]


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_kernels.available(), cpu_ext.unavailable_reason()


def make_layer(shape: tuple[int, ...], seed: int) -> MLAAttention:
    """An MLAAttention holding only what attention reads: kv_b_proj's halves and the scale."""
    heads, rank, rope, nope, v_dim = shape
    gen = torch.Generator().manual_seed(seed)
    mla = MLAConfig(kv_lora_rank=rank, qk_rope_head_dim=rope, qk_nope_head_dim=nope, v_head_dim=v_dim,
                    q_lora_rank=None)
    k_up = torch.randn(heads, nope, rank, generator=gen) * nope ** -0.5
    v_up = torch.randn(heads, v_dim, rank, generator=gen) * rank ** -0.5
    return MLAAttention(mla, heads, (nope + rope) ** -0.5, None, None, None, None, None, None, None,  # type: ignore[arg-type]
                        k_up, v_up, None)  # type: ignore[arg-type]


def make_step(layer: MLAAttention, dtype: torch.dtype, decode_lens: list[int], spans: list[tuple[int, int]],
              seed: int):
    """A step as the model runner lays it out: decode rows, then extend spans, every sequence on
    shuffled pages of a pool of garbage. Returns (q_nope, q_pe, rows, buffer, meta); rows hold the
    pool's rows at the extend rows' positions (what the layer stored before attending)."""
    mla, heads = layer.mla, layer.num_heads
    gen = torch.Generator().manual_seed(seed)
    lengths = decode_lens + [length + prefix for length, prefix in spans]
    pages_each = [-(-n // PAGE_SIZE) for n in lengths]
    num_pages = sum(pages_each) + 3
    width = mla.kv_lora_rank + mla.qk_rope_head_dim
    buffer = torch.randn(num_pages, LAYERS, 1, PAGE_SIZE, 1, width, generator=gen).to(dtype)
    order = torch.randperm(num_pages, generator=gen).to(torch.int32)
    tables, used = [], 0
    for count in pages_each:
        tables.append(order[used:used + count])
        used += count
    tokens = len(decode_lens) + sum(length for length, _ in spans)
    q_nope = torch.randn(tokens, heads, mla.qk_nope_head_dim, generator=gen).to(dtype)
    q_pe = torch.randn(tokens, heads, mla.qk_rope_head_dim, generator=gen).to(dtype)
    rows = torch.zeros(tokens, width, dtype=dtype)
    decode_table = decode_seq_lens = None
    if decode_lens:
        widest = max(pages_each[:len(decode_lens)])
        decode_table = torch.zeros(len(decode_lens), widest, dtype=torch.int32)
        for b, table in enumerate(tables[:len(decode_lens)]):
            decode_table[b, :len(table)] = table
        decode_seq_lens = torch.tensor(decode_lens, dtype=torch.int32)
    extends, start = [], len(decode_lens)
    for (length, prefix), table in zip(spans, tables[len(decode_lens):], strict=True):
        extends.append(ExtendSpan(start=start, length=length, prefix_len=prefix, page_ids=table.long()))
        for i in range(length):
            position = prefix + i
            rows[start + i] = buffer[table[position // PAGE_SIZE], LAYER, 0, position % PAGE_SIZE, 0]
        start += length
    meta = AttentionMetadata(slots=torch.zeros(tokens, dtype=torch.long), num_decode=len(decode_lens),
                             decode_page_table=decode_table, decode_seq_lens=decode_seq_lens, extends=extends)
    return q_nope, q_pe, rows, buffer, meta


def both_paths(layer: MLAAttention, step) -> tuple[torch.Tensor, torch.Tensor]:
    q_nope, q_pe, rows, buffer, meta = step
    kernel = CpuKernelLayerOps().mla_attention(layer, q_nope, q_pe, rows, buffer, LAYER, meta)
    reference = TorchLayerOps().mla_attention(layer, q_nope, q_pe, rows, buffer, LAYER, meta)
    return kernel, reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernel_matches_torch_path(dtype, shape):
    layer = make_layer(SHAPES[shape], 0)
    step = make_step(layer, dtype, DECODE_LENS, SPANS, 1)
    kernel, reference = both_paths(layer, step)
    assert kernel.dtype == dtype and kernel.shape == reference.shape and kernel.is_contiguous()
    torch.testing.assert_close(kernel.float(), reference.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("decode_lens, spans", [(DECODE_LENS, []), ([], SPANS), ([], [(70, 0)])])
def test_decode_only_and_extend_only_steps(decode_lens, spans):
    layer = make_layer(SHAPES["small-deepseek"], 2)
    kernel, reference = both_paths(layer, make_step(layer, torch.float32, decode_lens, spans, 3))
    torch.testing.assert_close(kernel, reference, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_bits_alone_in_a_batch_in_a_span_and_on_any_threads(dtype):
    # The last span row (position 34 + 15 = 49 of a 50-token sequence) and a decode row of the same
    # sequence, query and keys must agree bit for bit, alone or in any batch.
    layer = make_layer(SHAPES["small-deepseek"], 4)
    q_nope, q_pe, rows, buffer, meta = make_step(layer, dtype, [3, 77, 200], [(16, 34)], 5)
    ops = CpuKernelLayerOps()
    batch = ops.mla_attention(layer, q_nope, q_pe, rows, buffer, LAYER, meta)
    span = meta.extends[0]
    last = span.start + span.length - 1
    alone = AttentionMetadata(slots=meta.slots[:1], num_decode=1, decode_page_table=span.page_ids[None].int(),
                              decode_seq_lens=torch.tensor([50], dtype=torch.int32), extends=[])
    as_decode = ops.mla_attention(layer, q_nope[last:last + 1], q_pe[last:last + 1], rows[last:last + 1],
                                  buffer, LAYER, alone)
    assert torch.equal(as_decode[0], batch[last])
    # A decode row alone equals itself in the batch.
    second = AttentionMetadata(slots=meta.slots[:1], num_decode=1,
                               decode_page_table=meta.decode_page_table[1:2],
                               decode_seq_lens=meta.decode_seq_lens[1:2], extends=[])
    assert torch.equal(ops.mla_attention(layer, q_nope[1:2], q_pe[1:2], rows[1:2], buffer, LAYER, second)[0],
                       batch[1])
    # And the batch on one thread equals it on several.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(ops.mla_attention(layer, q_nope, q_pe, rows, buffer, LAYER, meta), batch)
    finally:
        torch.set_num_threads(threads)


def test_rejects_too_few_pages():
    layer = make_layer(SHAPES["small-deepseek"], 0)
    q_nope, q_pe, rows, buffer, meta = make_step(layer, torch.float32, [40], [], 0)
    meta.decode_page_table = meta.decode_page_table[:, :2]
    with pytest.raises(RuntimeError, match="needs 3 pages"):
        CpuKernelLayerOps().mla_attention(layer, q_nope, q_pe, rows, buffer, LAYER, meta)
