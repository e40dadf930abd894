"""kernels/csrc/bf16_gemm.cpp: y = x @ W.T + bias in bf16 on a weight packed once.

Accuracy: the kernel sums in fp32 and rounds to bf16 once, so against the exact (fp64) result it
is off by at most one bf16 ulp of the result plus the fp32 summation's own error (bounded by a few
fp32 ulps of the sum of |x_k * w_k|). Batch invariance is tested bit for bit: a row's output must
not depend on how many rows share the call, which rows they are, or the thread count.

Every test runs once per kernel variant the CPU executes (tests/cpu_isa.py): the avx512 library has
the kernel where the CPU has AVX512-BF16, the avx2 one always (AVX2 + FMA). Where a variant has none,
the Linear keeps oneDNN and its tests skip. Both variants sum each output in the same order and round
once, so where both run their results are equal bit for bit.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from engine.models.linear import Linear
from kernels import cpu_ext, cpu_kernels
from tests.cpu_isa import cpu_isa  # noqa: F401  (the fixture)


@pytest.fixture(autouse=True)
def gemm(cpu_isa):  # noqa: F811
    if not cpu_kernels.bf16_gemm_supported():
        pytest.skip(f"the {cpu_isa.name} kernels have no bf16 GEMM on this CPU (no AVX512-BF16)")
    return cpu_isa


def case(out_features: int, in_features: int, rows: int, bias: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=generator) * 0.05).bfloat16()
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    b = (torch.randn(out_features, generator=generator) * 0.1).bfloat16() if bias else None
    return x, weight, b


def assert_within_one_bf16_ulp(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                               bias: torch.Tensor | None):
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ weight.double().abs().T + (0 if bias is None else bias.double().abs())
    exponent = torch.floor(torch.log2(exact.abs().clamp(min=2.0 ** -126)))
    ulp = torch.pow(2.0, exponent - 7)  # bf16 keeps 8 significant bits
    bound = ulp + magnitude * 2.0 ** -20  # + the fp32 summation's error over K terms
    excess = (y.double() - exact).abs() - bound
    assert excess.max().item() <= 0, f"off by more than a bf16 ulp: worst excess {excess.max().item():.3g}"


# The small preset's shapes (K 768 / 2048 into 768, 1280, 2048, 4096 and the 32000 vocab), odd K, and
# N not a multiple of the 64-column group.
@pytest.mark.parametrize("in_features,out_features", [(768, 768), (768, 1280), (768, 2048), (768, 4096),
                                                      (2048, 768), (768, 32000), (77, 100), (130, 16)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_fp32_math_within_one_bf16_ulp(in_features, out_features, bias):
    x, weight, b = case(out_features, in_features, rows=9, bias=bias)
    y = cpu_kernels.bf16_gemm(x, cpu_kernels.pack_bf16_gemm_weight(weight), None if b is None else b.float(),
                              out_features)
    assert y.dtype == torch.bfloat16 and y.shape == (9, out_features)
    assert_within_one_bf16_ulp(y, x, weight, b)


@pytest.mark.parametrize("in_features,out_features", [(2048, 768), (129, 200)])
def test_a_row_does_not_depend_on_the_batch_or_threads(in_features, out_features):
    x, weight, b = case(out_features, in_features, rows=140, bias=True)  # > the 128-row block
    packed, b32 = cpu_kernels.pack_bf16_gemm_weight(weight), b.float()
    batch = cpu_kernels.bf16_gemm(x, packed, b32, out_features)
    for rows in range(1, 18):  # every row tile (1..6) and its combinations
        assert torch.equal(cpu_kernels.bf16_gemm(x[:rows], packed, b32, out_features), batch[:rows])
    alone = torch.cat([cpu_kernels.bf16_gemm(x[i:i + 1], packed, b32, out_features) for i in range(140)])
    assert torch.equal(alone, batch)
    shuffled = torch.randperm(140, generator=torch.Generator().manual_seed(1))
    assert torch.equal(cpu_kernels.bf16_gemm(x[shuffled].contiguous(), packed, b32, out_features),
                       batch[shuffled])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_kernels.bf16_gemm(x, packed, b32, out_features), batch)
    finally:
        torch.set_num_threads(threads)


def test_linear_uses_it_for_bf16_and_keeps_fp32_on_onednn():
    x, weight, b = case(300, 256, rows=5, bias=True)
    bf16 = Linear(weight, b)
    assert bf16.gemm
    y = bf16(x.reshape(5, 1, 256))  # leading dimensions kept
    assert y.shape == (5, 1, 300)
    assert_within_one_bf16_ulp(y.reshape(5, 300), x, weight, b)
    assert not Linear(weight.float(), b.float()).gemm


def test_bad_input_is_a_clear_error():
    x, weight, _ = case(64, 32, rows=2, bias=False)
    packed = cpu_kernels.pack_bf16_gemm_weight(weight)
    with pytest.raises(RuntimeError, match="inputs"):
        cpu_kernels.bf16_gemm(torch.zeros(2, 40, dtype=torch.bfloat16), packed, None, 64)
    with pytest.raises(RuntimeError, match="bf16"):
        cpu_kernels.bf16_gemm(x.float(), packed, None, 64)
    with pytest.raises(RuntimeError, match="out_features"):
        cpu_kernels.bf16_gemm(x, packed, None, 200)
    with pytest.raises(RuntimeError, match="bias"):
        cpu_kernels.bf16_gemm(x, packed, torch.zeros(3), 64)


def test_every_variant_gives_the_same_bits():
    variants = [v for v in cpu_ext.executable_isas()
                if cpu_ext.load(v) and cpu_ext.ops(v).bf16_gemm_supported()]
    if len(variants) < 2:
        pytest.skip("one variant with the bf16 GEMM runs here")
    for in_features, out_features in [(768, 2048), (2048, 768), (77, 100), (130, 16)]:
        x, weight, b = case(out_features, in_features, rows=13, bias=True, seed=in_features)
        packed, b32 = cpu_kernels.pack_bf16_gemm_weight(weight), b.float()
        first, *others = [cpu_ext.ops(v).bf16_gemm(x, packed, b32, out_features) for v in variants]
        for other in others:
            assert torch.equal(other, first)


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump")
def test_the_avx2_library_has_no_avx512_instruction():
    variant = cpu_ext.isa("avx2")
    if not cpu_ext.runs_here(variant):
        pytest.skip("this CPU has no AVX2")
    assert cpu_ext.load(variant), cpu_ext.unavailable_reason(variant)
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(cpu_ext.library_path(variant))],
                             capture_output=True, text=True, check=True).stdout
    assert "ymm" in listing  # it is vectorized, with AVX registers
    assert "zmm" not in listing and "%k1" not in listing  # and uses no 512-bit or mask register
