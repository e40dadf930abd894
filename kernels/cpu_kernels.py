"""Python entry points of the C++ CPU kernels in kernels/csrc (see kernels.cpu_ext for the build).

Each function has a torch counterpart it is tested against: `paged_decode_attention` against
kernels.torch_ops.paged_decode_attention_torch, `extend_attention` against torch SDPA over the
gathered pages (engine.models.attention's torch extend path), `mla_attention` against
engine.models.mla.MLAAttention.attend_torch, the layer ops against the torch op chains of
engine.models.layer_ops.TorchLayerOps, `bf16_gemm` against the exact (fp64) product. Call
`available()` first: without the built library there are none of these ops. They run on the library of
the process's instruction set (kernels.cpu_ext.active_isa(): PDSERVE_CPU_ISA, or the best the CPU runs).
"""

from __future__ import annotations

import torch

from kernels import cpu_ext


def available() -> bool:
    return cpu_ext.load()


def _int32(values: torch.Tensor) -> torch.Tensor:
    return values if values.dtype == torch.int32 else values.to(torch.int32)


def paged_decode_attention(q: torch.Tensor, buffer: torch.Tensor, layer: int, page_table: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Same contract as kernels.ops.paged_decode_attention, read straight from the pages (no gather)."""
    return cpu_ext.ops().paged_decode_attention(q, buffer, layer, _int32(page_table),
                                                        _int32(seq_lens), scale)


def extend_attention(q: torch.Tensor, buffer: torch.Tensor, layer: int, page_ids: torch.Tensor,
                     prefix_len: int, scale: float) -> torch.Tensor:
    """Causal attention of one extend span's queries q [L, Hq, D] (positions prefix_len ..
    prefix_len + L - 1) over the span's prefix_len + L keys, read straight from its pages
    `page_ids` (the new tokens' K/V already stored there). head_dim 32, 64, 128 or 256."""
    return cpu_ext.ops().extend_attention(q, buffer, layer, _int32(page_ids), prefix_len, scale)


def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, buffer: torch.Tensor, layer: int,
                  k_up: torch.Tensor, v_up_t: torch.Tensor, scale: float,
                  decode_page_table: torch.Tensor | None, decode_seq_lens: torch.Tensor | None,
                  span_page_ids: list[torch.Tensor], span_starts: list[int], span_lengths: list[int],
                  span_prefix_lens: list[int]) -> torch.Tensor:
    """Absorbed multi-head latent attention (engine.models.mla) of a batch's rows, read straight from the
    MLA pool's [latent | k_pe] rows: q_nope [T, H, nope] and rotated q_pe [T, H, rope] in the pool's
    dtype, k_up [H, nope, kv_lora_rank] and v_up_t [H, kv_lora_rank, v_head_dim] in fp32 -> [T, H,
    v_head_dim]. The first decode_page_table.shape[0] rows are decode rows (one per sequence, seeing
    its seq_len keys); span i's rows [start, start + length) see its prefix and its own rows up to
    theirs. Same contract as MLAAttention.attend_torch."""
    return cpu_ext.ops().mla_attention(
        q_nope, q_pe, buffer, layer, k_up, v_up_t, scale,
        None if decode_page_table is None else _int32(decode_page_table),
        None if decode_seq_lens is None else _int32(decode_seq_lens),
        [_int32(p) for p in span_page_ids], span_starts, span_lengths, span_prefix_lens)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm of the rows of a contiguous 2-d x."""
    return cpu_ext.ops().rms_norm(x, weight, eps)


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place, rounded to its dtype), then return rms_norm(residual)."""
    return cpu_ext.ops().add_rms_norm(residual, x, weight, eps)


def qk_norm_rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                       buffer: torch.Tensor, layer: int, slots: torch.Tensor, num_heads: int,
                       num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From fused projections qkv [T, (Hq + 2 Hkv) * D]: q [T, Hq, D] and k [T, Hkv, D] after the
    optional per-head norms and rotary at `positions` (rows of the full cos/sin tables); K and V are
    also written to `slots` of `layer` in the pool."""
    return cpu_ext.ops().qk_norm_rope_store(qkv, positions, cos, sin, q_norm, k_norm, eps, buffer,
                                                    layer, slots, num_heads, num_kv_heads)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dimension."""
    return cpu_ext.ops().silu_and_mul(gate_up)


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
    """Routed experts of a MoE layer (kernels/csrc/moe_experts.cpp): out[t] = sum_j weights[t, j] *
    down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, j], for x [T, H], ids/weights [T, k] and all
    experts' stacked gate_up [E, 2I, H] and down [E, H, I] in x's dtype; rounds where engine.models.moe's
    torch path does, and a token's sums never depend on the other rows."""
    return cpu_ext.ops().moe_experts(x, ids, weights, gate_up, down)


BF16_GEMM_GROUP = 64  # outputs per packed group of kernels/csrc/bf16_gemm.cpp


def bf16_gemm_supported() -> bool:
    """Whether the built library has the bf16 GEMM: the avx512 variant on CPUs with AVX512-BF16, and the
    avx2 variant."""
    return available() and bool(cpu_ext.ops().bf16_gemm_supported())


def bf16_gemm_preferred() -> bool:
    """Whether bf16 linears should run on the C++ GEMM rather than oneDNN: whenever it is built.
    On a CPU with AMX oneDNN's AMX kernels are faster for long prompts, but their sums depend on
    the row count (a request's logprobs changed with the batch it ran in:
    tests/engine/test_batch_invariance.py failed on an Emerald Rapids with AMX), and a token must
    not depend on the load it was served under; the C++ GEMM sums every output in one order."""
    return bf16_gemm_supported()


def pack_bf16_gemm_weight(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] bf16 -> [ceil(N / 64), ceil(K / 2), 64, 2]: per group of 64 outputs, each pair of
    inputs' 64 x 2 weights contiguous (what one step of the kernel's inner loop loads). The padding
    is zeros, so it adds nothing to any sum."""
    out_features, in_features = weight.shape
    groups, pairs = -(-out_features // BF16_GEMM_GROUP), -(-in_features // 2)
    padded = weight.to(torch.bfloat16).contiguous()
    if (groups * BF16_GEMM_GROUP, pairs * 2) != tuple(weight.shape):  # no padded copy where none is needed
        padded = torch.zeros(groups * BF16_GEMM_GROUP, pairs * 2, dtype=torch.bfloat16)
        padded[:out_features, :in_features] = weight
    return padded.view(groups, BF16_GEMM_GROUP, pairs, 2).permute(0, 2, 1, 3).contiguous()


def bf16_gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
              out_features: int) -> torch.Tensor:
    """y = x @ W.T + bias for a contiguous 2-d bf16 x and W packed by pack_bf16_gemm_weight: fp32 sums
    in a fixed order per output (a row's result never depends on the other rows), one bf16 rounding."""
    return cpu_ext.ops().bf16_gemm(x, packed, bias, out_features)


def lora_delta_add(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                   row_slots: torch.Tensor, scales: torch.Tensor, ranks: torch.Tensor,
                   bounds: tuple[int, ...]) -> torch.Tensor:
    """out[t] += scales[s] * Bt_s^T @ A_s @ x[t] in place for each row t of slot s = row_slots[t] >= 0,
    reading only the slot's `ranks[s]` rows of each sub-module and B's blocks of sub-module m on
    columns [bounds[m], bounds[m+1]) (engine.lora.ops's slot layout; `lora_delta_reference` is the
    reference)."""
    return cpu_ext.ops().lora_delta_add(out, x, a, bt, row_slots, scales, ranks, bounds)
