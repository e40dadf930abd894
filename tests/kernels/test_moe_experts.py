"""The fused routed-experts op (kernels/csrc/moe_experts.cpp) against engine.models.moe's torch path.

Tolerances: in fp32 the two differ only in the matmuls' summation order (and silu's exp), so
1e-5 relative; in bf16 every rounding point is the same, so results are equal but where an fp32
matmul sum lands within rounding distance of a bf16 tie, after which the difference can carry
through silu * up and the down projection: a few bf16 ulps (rtol 2e-2, atol 2e-2 on values of
order 1; on AVX512-BF16 CPUs the op's bf16 products are vdpbf16ps's, exact but with denormals
flushed). Batch invariance is exact: a token's output is bit-identical alone and in a batch.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.models.linear import Linear
from engine.models.moe import routed_experts_torch
from kernels import cpu_ext, cpu_kernels
from tests.cpu_isa import cpu_isa  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.skipif(shutil.which(cpu_ext.COMPILER) is None, reason="no C++ compiler"),
              pytest.mark.usefixtures("cpu_isa")]  # once per kernel variant this CPU runs

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
             torch.float16: dict(rtol=5e-3, atol=5e-3)}


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_kernels.available(), cpu_ext.unavailable_reason()


def make_experts(num_experts, hidden, width, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(num_experts, 2 * width, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, width, generator=gen) / width ** 0.5).to(dtype)
    return gate_up, down


def route(tokens, num_experts, top_k, seed, weight_dtype=torch.float32, unused=()):
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(num_experts) if e not in unused])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:top_k]] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen).softmax(-1).to(weight_dtype)
    return ids, weights


def reference(x, ids, weights, gate_up, down):
    experts = [(Linear(gate_up[e]), Linear(down[e])) for e in range(gate_up.shape[0])]
    counts = torch.bincount(ids.view(-1), minlength=gate_up.shape[0])
    return routed_experts_torch(x, ids, weights, experts, counts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 3, 16, 37])
@pytest.mark.parametrize("shape", [(8, 256, 96, 2), (16, 768, 192, 4), (4, 200, 50, 3)])  # E, H, I, k
def test_matches_torch(dtype, tokens, shape):
    num_experts, hidden, width, top_k = shape
    gate_up, down = make_experts(num_experts, hidden, width, dtype, seed=tokens)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(7)).to(dtype)
    # Expert 1 never chosen; with Qwen3-MoE's weights in the model dtype in bf16.
    weight_dtype = dtype if dtype != torch.float32 and tokens % 2 else torch.float32
    ids, weights = route(tokens, num_experts, top_k, seed=tokens + hidden, weight_dtype=weight_dtype,
                         unused=(1,))
    got = cpu_kernels.moe_experts(x, ids, weights, gate_up, down)
    want = reference(x, ids, weights, gate_up, down)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])


def test_every_expert_row_count_edge():
    # Experts receiving 1..9 rows (the register tile is 4 rows: 4, 5, 8 and 9 cross its edges),
    # one receiving none, and a token choosing the same expert twice (the torch path sums both).
    num_experts, hidden, width = 10, 160, 40
    gate_up, down = make_experts(num_experts, hidden, width, torch.float32, seed=3)
    ids = torch.tensor([e for e in range(1, num_experts) for _ in range(e)])  # expert e gets e rows
    ids = torch.stack([ids, ids.roll(7)], dim=1)
    ids[0] = torch.tensor([5, 5])
    x = torch.randn(ids.shape[0], hidden, generator=torch.Generator().manual_seed(1))
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(2))
    got = cpu_kernels.moe_experts(x, ids, weights, gate_up, down)
    torch.testing.assert_close(got, reference(x, ids, weights, gate_up, down), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_is_batch_invariant(dtype):
    num_experts, hidden, width, top_k = 16, 768, 192, 4
    gate_up, down = make_experts(num_experts, hidden, width, dtype, seed=5)
    x = torch.randn(16, hidden, generator=torch.Generator().manual_seed(4)).to(dtype)
    ids, weights = route(16, num_experts, top_k, seed=6)
    batch = cpu_kernels.moe_experts(x, ids, weights, gate_up, down)
    for t in range(16):
        alone = cpu_kernels.moe_experts(x[t:t + 1], ids[t:t + 1], weights[t:t + 1], gate_up, down)
        assert torch.equal(alone[0], batch[t]), f"token {t}"
    # and with the batch in another order (other experts' rows around it)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(8))
    shuffled = cpu_kernels.moe_experts(x[perm].contiguous(), ids[perm], weights[perm], gate_up, down)
    assert torch.equal(shuffled, batch[perm])


def test_rejects_bad_shapes():
    gate_up, down = make_experts(4, 64, 32, torch.float32, seed=0)
    x = torch.randn(2, 64)
    ids, weights = route(2, 4, 2, seed=0)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_kernels.moe_experts(x, ids + 4, weights, gate_up, down)
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_kernels.moe_experts(x.bfloat16(), ids, weights, gate_up, down)
