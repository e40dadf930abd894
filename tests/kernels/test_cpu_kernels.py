"""The C++ CPU kernels (kernels/csrc) against their torch references.

Tolerances: fp32 results differ from the torch op chains only by summation order and by the
polynomial exp (a few ulp), so 1e-5; bf16/fp16 kernels round at the same points as the torch
chains, so results are equal but for an occasional one-ulp difference where an fp32 intermediate
lands within rounding distance of a tie (one bf16 ulp is 2^-8 relative: rtol 1e-2).

`make setup` builds the library; these tests fail (not skip) when it is missing on a machine with
a compiler, because the engine would then silently run the slower torch path.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.models.layer_ops import CpuKernelLayerOps, HeadShape, TorchLayerOps, select_layer_ops
from engine.models.rope import RotaryTable
from kernels import cpu_ext, cpu_kernels
from kernels.torch_ops import paged_decode_attention_torch
from tests.cpu_isa import cpu_isa  # noqa: F401  (the fixture)
from tests.kernels.paged_case import dense_decode_attention, make_case

pytestmark = [pytest.mark.skipif(shutil.which(cpu_ext.COMPILER) is None, reason="no C++ compiler"),
              pytest.mark.usefixtures("cpu_isa")]  # once per kernel variant this CPU runs

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
             torch.float16: dict(rtol=1e-3, atol=1e-3)}


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_kernels.available(), cpu_ext.unavailable_reason()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 96, 48, 40])  # vector path (multiples of 16) and scalar path
@pytest.mark.parametrize("num_q_heads", [2, 6, 18])  # GQA 1:1, 3:1 and 9:1 over 2 KV heads
def test_paged_decode_attention_matches_torch(dtype, head_dim, num_q_heads):
    case = make_case([1, 13, 8, 33, 70], num_q_heads=num_q_heads, head_dim=head_dim, dtype=dtype,
                     page_size=16, filler=10_000, seed=head_dim + num_q_heads)
    for layer in range(2):
        got = cpu_kernels.paged_decode_attention(case.q, case.buffer, layer, case.page_table, case.seq_lens,
                                                 0.3)
        want = paged_decode_attention_torch(case.q, case.buffer, layer, case.page_table, case.seq_lens, 0.3)
        assert got.dtype == dtype and got.shape == case.q.shape
        torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])


def test_paged_decode_attention_splits_long_sequences():
    # One long sequence and few heads: too few items for the threads, so it is split into spans
    # whose partial softmaxes are merged; the result must not depend on that.
    case = make_case([1500], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16, seed=3)
    torch.set_num_threads(2)
    got = cpu_kernels.paged_decode_attention(case.q, case.buffer, 1, case.page_table, case.seq_lens, 0.2)
    want = dense_decode_attention(case.q, case.dense_k[1], case.dense_v[1], 0.2)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_attention_is_batch_invariant(dtype):
    # A sequence's output must be bit-identical alone, in any batch and at any thread count: greedy
    # tokens that depend on the load a request was served under are wrong answers. Lengths cover
    # one span, several spans (300, 700 > 256-token spans) and a page size (24) that is not a
    # multiple of the 16-token blocks.
    for page_size in (16, 24):
        case = make_case([300, 40, 700, 1, 257, 90], num_q_heads=6, num_kv_heads=2, head_dim=64, dtype=dtype,
                         page_size=page_size, num_layers=1, seed=page_size)
        threads = torch.get_num_threads()
        try:
            outputs = []
            for num_threads in (1, 2):
                torch.set_num_threads(num_threads)
                outputs.append(cpu_kernels.paged_decode_attention(case.q, case.buffer, 0, case.page_table,
                                                                  case.seq_lens, 0.125))
                for b in range(len(case.seq_lens)):
                    rows = slice(b, b + 1)
                    alone = cpu_kernels.paged_decode_attention(case.q[rows], case.buffer, 0,
                                                               case.page_table[rows], case.seq_lens[rows],
                                                               0.125)
                    assert torch.equal(alone[0], outputs[-1][b]), (page_size, num_threads, b)
            assert torch.equal(outputs[0], outputs[1])
        finally:
            torch.set_num_threads(threads)


def test_paged_decode_attention_zero_length_gives_zeros():
    case = make_case([4, 6], page_size=4)
    lens = torch.tensor([0, 6], dtype=torch.int32)
    got = cpu_kernels.paged_decode_attention(case.q, case.buffer, 0, case.page_table, lens, 0.25)
    assert torch.equal(got[0], torch.zeros_like(got[0]))


def test_paged_decode_attention_rejects_a_short_page_table():
    case = make_case([9], page_size=4)
    with pytest.raises(RuntimeError, match="needs 3 pages"):
        cpu_kernels.paged_decode_attention(case.q, case.buffer, 0, case.page_table[:, :2], case.seq_lens,
                                           0.25)


def _rows(dtype: torch.dtype, rows: int, size: int, seed: int) -> torch.Tensor:
    return (torch.randn(rows, size, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("size", [768, 40])  # a tail shorter than the vector width in the second
def test_norms_and_silu_match_torch(dtype, size):
    torch_ops, fused = TorchLayerOps(), CpuKernelLayerOps()
    x, y, weight = _rows(dtype, 5, size, 0), _rows(dtype, 5, size, 1), _rows(dtype, 1, size, 2)[0]
    torch.testing.assert_close(fused.rms_norm(x, weight, 1e-6), torch_ops.rms_norm(x, weight, 1e-6),
                               **TOLERANCE[dtype])
    residual_torch, residual_fused = x.clone(), x.clone()
    want = torch_ops.add_rms_norm(residual_torch, y, weight, 1e-6)
    got = fused.add_rms_norm(residual_fused, y, weight, 1e-6)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    assert torch.equal(residual_fused, residual_torch)  # the in-place sum rounds exactly like add_
    gate_up = _rows(dtype, 5, 2 * size, 3)
    torch.testing.assert_close(fused.silu_and_mul(gate_up), torch_ops.silu_and_mul(gate_up),
                               **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_norm", [True, False])  # Qwen3 (q/k norms) and Llama
@pytest.mark.parametrize("head_dim", [64, 48])  # half of 48 is not a multiple of 16: tails
def test_qk_norm_rope_store_matches_torch(dtype, with_norm, head_dim):
    from engine.models.config import RopeConfig

    shape = HeadShape(num_heads=6, num_kv_heads=2, head_dim=head_dim)
    tokens, page_size = 7, 4
    qkv = _rows(dtype, tokens, shape.q_size + 2 * shape.kv_size, 4)
    norms = (_rows(dtype, 1, head_dim, 5)[0], _rows(dtype, 1, head_dim, 6)[0]) if with_norm else (None, None)
    rotary = RotaryTable(RopeConfig(theta=10000.0), head_dim, 4096, dtype, torch.device("cpu"), initial=64)
    positions = torch.tensor([0, 1, 2, 5, 63, 100, 17])  # 100 grows the table
    slots = torch.tensor([3, 9, 10, 0, 21, 22, 30])
    results = []
    for ops in (TorchLayerOps(), CpuKernelLayerOps()):
        buffer = torch.zeros(8, 2, 2, page_size, shape.num_kv_heads, head_dim, dtype=dtype)
        q, k, v = ops.qk_norm_rope_store(qkv, ops.rotary(rotary, positions, int(positions.max())), *norms,
                                         1e-6, shape, buffer, 1, slots)
        results.append((q, k, v, buffer))
    (q0, k0, v0, b0), (q1, k1, v1, b1) = results
    for got, want in ((q1, q0), (k1, k0), (b1, b0)):
        torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    assert torch.equal(v1, v0)
    assert b1[:, 0].abs().sum() == 0  # layer 0 untouched


def test_select_layer_ops_modes(monkeypatch):
    cpu = torch.device("cpu")
    assert type(select_layer_ops("off", cpu)) is TorchLayerOps
    assert type(select_layer_ops("auto", cpu)) is CpuKernelLayerOps
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    monkeypatch.setattr(cpu_ext, "unavailable_reason", lambda: "not built")
    assert type(select_layer_ops("auto", cpu)) is TorchLayerOps
    with pytest.raises(RuntimeError, match="not built"):
        select_layer_ops("on", cpu)
    with pytest.raises(ValueError, match="cpu_kernels"):
        select_layer_ops("fast", cpu)


def test_build_is_cached_and_keyed_by_sources(tmp_path, monkeypatch):
    assert cpu_ext.build() == cpu_ext.library_path()  # already built: returns at once
    key = cpu_ext.build_key()
    copy = tmp_path / "csrc"
    shutil.copytree(cpu_ext.SOURCE_DIR, copy)
    monkeypatch.setattr(cpu_ext, "SOURCE_DIR", copy)
    assert cpu_ext.build_key() == key
    (copy / "numerics.h").write_text((copy / "numerics.h").read_text() + "\n// changed\n")
    assert cpu_ext.build_key() != key
