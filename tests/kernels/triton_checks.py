"""Each Triton kernel against its torch reference, run under Triton's interpreter on CPU tensors.

Run as `TRITON_INTERPRET=1 python -m tests.kernels.triton_checks [CASE ...]` from the repo root;
it prints one JSON line per case ({"case", "ok", "error"}). test_triton_interpret.py runs it in a
subprocess because TRITON_INTERPRET must be set before triton is first imported, and the pytest
process may already have imported triton for other tests. This module itself imports triton only
inside the cases (through kernels.ops' lazy *_triton names), so pytest can list CASES cheaply.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable

import torch

from kernels import ops
from tests.kernels.paged_case import dense_decode_attention, make_case

CASES: dict[str, Callable[[], None]] = {}


def case(fn: Callable[[], None]) -> Callable[[], None]:
    CASES[fn.__name__] = fn
    return fn


def _check_attention(seq_lens, *, num_q_heads=4, dtype=torch.float32, head_dim=16, page_size=4,
                     filler=0, block_n=16, tol=1e-5, seed=0):
    c = make_case(seq_lens, num_q_heads=num_q_heads, dtype=dtype, head_dim=head_dim, page_size=page_size,
                  filler=filler, seed=seed)
    scale = head_dim ** -0.5
    for layer in range(2):
        got = ops.paged_decode_attention_triton(c.q, c.buffer, layer, c.page_table, c.seq_lens, scale,
                                                block_n=block_n)
        ref = ops.paged_decode_attention_torch(c.q, c.buffer, layer, c.page_table, c.seq_lens, scale)
        dense = dense_decode_attention(c.q, c.dense_k[layer], c.dense_v[layer], scale)
        assert got.dtype == dtype and got.shape == c.q.shape
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
        torch.testing.assert_close(got.double(), dense, rtol=tol, atol=tol)


@case
def attention_mha_fp32():
    _check_attention([1, 13, 8], num_q_heads=2)


@case
def attention_gqa2_fp32_multi_block():
    # lengths past block_n=16 exercise the online-softmax rescaling across loop steps
    _check_attention([37, 5, 16, 17], num_q_heads=4, filler=10_000)


@case
def attention_gqa4_fp32_odd_shapes():
    # head_dim 24 and page_size 3 are not powers of two: padded lanes must stay masked
    _check_attention([10, 2, 7], num_q_heads=8, head_dim=24, page_size=3, seed=3)


@case
def attention_gqa2_bf16():
    _check_attention([9, 20, 3], num_q_heads=4, dtype=torch.bfloat16, tol=2e-2)


@case
def attention_fp16_block_spans_pages():
    _check_attention([11, 6], num_q_heads=4, dtype=torch.float16, page_size=2, block_n=32, tol=2e-3)


@case
def attention_strided_q_and_zero_length():
    c = make_case([6, 9, 4], num_q_heads=4)
    qkv = torch.zeros(3, 3 * 4, 16)  # q as a non-contiguous slice of a fused projection
    q = qkv[:, 4:8]
    q.copy_(c.q)
    lens = torch.tensor([6, 0, 4], dtype=torch.int64)
    got = ops.paged_decode_attention_triton(q, c.buffer, 0, c.page_table, lens, 0.25, block_n=16)
    ref = ops.paged_decode_attention_torch(c.q, c.buffer, 0, c.page_table, lens, 0.25)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@case
def attention_strided_page_table_and_lens():
    c = make_case([7, 12, 2], num_q_heads=4, filler=-1)
    wide = torch.full((3, 2 * c.page_table.shape[1]), -7, dtype=torch.int64)
    wide[:, ::2] = c.page_table
    table = wide[:, ::2]  # column stride 2: every other entry of a wider table
    lens = torch.tensor([[7, 0], [12, 0], [2, 0]], dtype=torch.int32)[:, 0]  # stride 2 as well
    got = ops.paged_decode_attention_triton(c.q, c.buffer, 1, table, lens, 0.25, block_n=16)
    ref = ops.paged_decode_attention_torch(c.q, c.buffer, 1, table, lens, 0.25)
    dense = dense_decode_attention(c.q, c.dense_k[1], c.dense_v[1], 0.25)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.double(), dense, rtol=1e-5, atol=1e-5)


def _check_store(dtype):
    c = make_case([7, 10], dtype=dtype)
    gen = torch.Generator().manual_seed(5)
    # k, v as strided views of one fused tensor, written into a shuffled set of slots
    fused = torch.randn(6, 3, 2, 16, generator=gen, device="cpu").to(
        dtype=dtype, device=torch.get_default_device())
    k, v = fused[:, 1], fused[:, 2]
    slots = torch.tensor([c.page_ids[1][2] * 4 + 1, c.page_ids[0][0] * 4 + 3, c.page_ids[1][0] * 4,
                          c.page_ids[0][1] * 4 + 2, c.page_ids[1][1] * 4 + 3, c.page_ids[0][0] * 4])
    got, want = c.buffer.clone(), c.buffer.clone()
    ops.store_kv_triton(got, 1, slots, k, v)
    ops.store_kv_torch(want, 1, slots, k, v)
    assert torch.equal(got, want)
    assert not torch.equal(got, c.buffer)


@case
def store_kv_fp32_strided_inputs():
    _check_store(torch.float32)


@case
def store_kv_bf16():
    _check_store(torch.bfloat16)


@case
def gather_kv_matches_torch():
    c = make_case([13, 6], dtype=torch.bfloat16)
    for layer in range(2):
        for n_tokens in (1, 4, 11, 13):
            ids = torch.tensor(c.page_ids[0] + [9_999])  # a trailing id beyond the tokens: unread
            got_k, got_v = ops.gather_kv_triton(c.buffer, layer, ids, n_tokens)
            want_k, want_v = ops.gather_kv_torch(c.buffer, layer, ids, n_tokens)
            assert got_k.is_contiguous() and torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
            assert torch.equal(got_k, c.dense_k[layer][0][:n_tokens])


@case
def gather_scatter_pages_round_trip():
    c = make_case([5, 12, 3], dtype=torch.bfloat16)
    ids = torch.tensor([c.page_ids[1][2], c.page_ids[0][0], c.page_ids[1][0]])
    staged = ops.gather_pages_triton(c.buffer, ids)
    assert torch.equal(staged, ops.gather_pages_torch(c.buffer, ids))
    target = torch.zeros_like(c.buffer)
    dst = torch.tensor([7, 2, 4])
    ops.scatter_pages_triton(target, dst, staged)
    want = torch.zeros_like(c.buffer)
    ops.scatter_pages_torch(want, dst, staged)
    assert torch.equal(target, want)
    assert torch.equal(target[dst], c.buffer[ids])


def _check_lora(dtype, tol):
    from engine.lora.ops import lora_delta_reference
    from tests.kernels.lora_case import random_pool

    # q/k/v-like sub-modules of unequal widths (none a multiple of a block), slot ranks under the pool's
    bounds, rank = (0, 40, 58, 76), 8
    a, bt = random_pool(4, rank, bounds, 70, [8, 3, 0, 5], seed=4, dtype=dtype)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(9, 70, generator=generator).to(dtype)
    base = torch.randn(9, 76, generator=generator).to(dtype)
    row_slots = torch.tensor([3, -1, 0, 0, 1, -1, 2, 3, 3])
    scales = torch.tensor([0.5, 2.0, 1.5, 0.25])
    got = ops.lora_delta_add_triton(base.clone(), x, a, bt, row_slots, scales, bounds)
    want = base.float() + lora_delta_reference(x, a, bt, row_slots, scales).float()
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    assert torch.equal(got[1], base[1]) and torch.equal(got[5], base[5])  # base rows untouched
    alone = ops.lora_delta_add_triton(base[7:8].clone(), x[7:8], a, bt, row_slots[7:8], scales, bounds)
    assert torch.equal(alone[0], got[7])  # a row's result does not depend on its batch


@case
def lora_delta_fp32():
    _check_lora(torch.float32, 1e-4)


@case
def lora_delta_bf16():
    _check_lora(torch.bfloat16, 3e-2)


def main(names: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1: these checks run the kernels on CPU tensors", file=sys.stderr)
        return 2
    failed = 0
    for name in names or list(CASES):
        try:
            CASES[name]()
            result = {"case": name, "ok": True, "error": ""}
        except Exception:  # report every case, not just the first failure
            failed += 1
            result = {"case": name, "ok": False, "error": traceback.format_exc()}
        print(json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
