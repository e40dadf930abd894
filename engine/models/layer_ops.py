"""The non-matmul ops of a decoder layer, in two interchangeable implementations.

`TorchLayerOps` chains torch ops (any device; the reference). `CpuKernelLayerOps` runs each op as
one fused C++ kernel (kernels.cpu_kernels) and reads decode and extend K/V straight from the pages. Both
round at the same points as HF transformers, so fp32 results agree to summation order and bf16
results to an occasional last-bit difference. `select_layer_ops` picks one for an engine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.models.attention import AttentionMetadata, ExtendSpan, extend_attention_torch
from engine.models.rope import RotaryTable, apply_rotary
from kernels import cpu_ext, cpu_kernels, ops

if TYPE_CHECKING:
    from engine.models.mla import MLAAttention  # which imports this module's rms_norm

log = logging.getLogger(__name__)

# Per-forward rotary inputs, in the form of the ops that made them (`rotary`, `rotary_rows`) and
# read them (`qk_norm_rope_store`): TorchLayerOps' (cos, sin), CpuKernelLayerOps' (positions, cos, sin).
Rotary = tuple[torch.Tensor, ...]

CPU_KERNEL_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class HeadShape:
    """One rank's attention heads: query heads, KV heads and their size (the qkv projection's split)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm: normalize in fp32, cast back, then scale by the weight."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class TorchLayerOps:
    """Torch op chains for every device."""

    # MoE layers: per-expert prepacked Linears (engine.models.moe's torch path), or, when True, every
    # expert's weights stacked for the fused C++ op kernels.cpu_kernels.moe_experts.
    fused_moe_experts = False

    def describe(self) -> str:
        """Which kernels run, for a worker's start line and the benchmarks."""
        return "torch ops"

    def rotary(self, table: RotaryTable, positions: torch.Tensor, max_position: int) -> Rotary:
        """Per-forward rotary inputs, passed to every layer's `qk_norm_rope_store`."""
        return table.lookup(positions, max_position)

    def rotary_rows(self, cos: torch.Tensor, sin: torch.Tensor) -> Rotary:
        """Per-forward rotary inputs from each token's own cos/sin [T, head_dim] (M-RoPE)."""
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """residual += x in place; returns rms_norm(residual)."""
        residual.add_(x)
        return rms_norm(residual, weight, eps)

    def qk_norm_rope_store(self, qkv: torch.Tensor, rotary: Rotary, q_norm: torch.Tensor | None,
                           k_norm: torch.Tensor | None, eps: float, shape: HeadShape, buffer: torch.Tensor,
                           layer: int, slots: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k and v [T, Hkv, D] from fused projections; K/V stored in the pool. The q/k
        norms come both or neither (the loader refuses one without the other)."""
        cos, sin = rotary
        tokens = qkv.shape[0]
        q, k, v = qkv.split([shape.q_size, shape.kv_size, shape.kv_size], dim=-1)
        q = q.view(tokens, shape.num_heads, shape.head_dim)
        k = k.view(tokens, shape.num_kv_heads, shape.head_dim)
        v = v.view(tokens, shape.num_kv_heads, shape.head_dim)
        if q_norm is not None and k_norm is not None:
            q = rms_norm(q, q_norm, eps)
            k = rms_norm(k, k_norm, eps)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        ops.store_kv(buffer, layer, slots, k, v)
        return q, k, v

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def paged_decode_attention(self, q: torch.Tensor, buffer: torch.Tensor, layer: int,
                               page_table: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
        return ops.paged_decode_attention(q, buffer, layer, page_table, seq_lens, scale)

    def extend_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, buffer: torch.Tensor,
                         layer: int, span: ExtendSpan, scale: float) -> torch.Tensor:
        return extend_attention_torch(q, k, v, buffer, layer, span, scale)

    def mla_attention(self, mla: MLAAttention, q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor,
                      buffer: torch.Tensor, layer: int, meta: AttentionMetadata) -> torch.Tensor:
        """An MLA layer's absorbed attention [T, H, v_head_dim]."""
        return mla.attend_torch(q_nope, q_pe, rows, buffer, layer, meta)


# Head dims the C++ extend kernel is compiled for (others keep torch SDPA).
EXTEND_KERNEL_HEAD_DIMS = (32, 64, 128, 256)


class CpuKernelLayerOps(TorchLayerOps):
    """The fused C++ kernels of kernels/csrc (CPU tensors only)."""

    fused_moe_experts = True

    def describe(self) -> str:
        linears = "C++ bf16 GEMM" if cpu_kernels.bf16_gemm_preferred() else "oneDNN"
        return f"C++ CPU kernels {cpu_ext.active_isa().name} (bf16 linears: {linears})"

    def rotary(self, table: RotaryTable, positions: torch.Tensor, max_position: int) -> Rotary:
        return positions, *table.tables(max_position)

    def rotary_rows(self, cos: torch.Tensor, sin: torch.Tensor) -> Rotary:
        # the kernel gathers cos/sin rows by position: token i reads row i
        return torch.arange(cos.shape[0], device=cos.device), cos, sin

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return cpu_kernels.rms_norm(x, weight, eps)

    def add_rms_norm(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        return cpu_kernels.add_rms_norm(residual, x, weight, eps)

    def qk_norm_rope_store(self, qkv: torch.Tensor, rotary: Rotary, q_norm: torch.Tensor | None,
                           k_norm: torch.Tensor | None, eps: float, shape: HeadShape, buffer: torch.Tensor,
                           layer: int, slots: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        positions, cos, sin = rotary
        q, k = cpu_kernels.qk_norm_rope_store(qkv, positions, cos, sin, q_norm, k_norm, eps, buffer, layer,
                                              slots, shape.num_heads, shape.num_kv_heads)
        v = qkv[:, shape.q_size + shape.kv_size:].view(qkv.shape[0], shape.num_kv_heads, shape.head_dim)
        return q, k, v

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.silu_and_mul(gate_up)

    def paged_decode_attention(self, q: torch.Tensor, buffer: torch.Tensor, layer: int,
                               page_table: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
        return cpu_kernels.paged_decode_attention(q, buffer, layer, page_table, seq_lens, scale)

    def extend_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, buffer: torch.Tensor,
                         layer: int, span: ExtendSpan, scale: float) -> torch.Tensor:
        if q.shape[-1] not in EXTEND_KERNEL_HEAD_DIMS:
            return extend_attention_torch(q, k, v, buffer, layer, span, scale)
        return cpu_kernels.extend_attention(q, buffer, layer, span.page_ids, span.prefix_len, scale)

    def mla_attention(self, mla: MLAAttention, q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor,
                      buffer: torch.Tensor, layer: int, meta: AttentionMetadata) -> torch.Tensor:
        spans = meta.extends
        return cpu_kernels.mla_attention(
            q_nope, q_pe, buffer, layer, mla.k_up, mla.v_up_t, mla.scale,
            meta.decode_page_table if meta.num_decode else None,
            meta.decode_seq_lens if meta.num_decode else None,
            [s.page_ids for s in spans], [s.start for s in spans], [s.length for s in spans],
            [s.prefix_len for s in spans])


def select_layer_ops(mode: str, device: torch.device) -> TorchLayerOps:
    """`auto`: the C++ kernels on CPU when they are built, else torch (with a warning saying why);
    `on`: the C++ kernels or an error; `off`: torch."""
    if mode not in CPU_KERNEL_MODES:
        raise ValueError(f"cpu_kernels must be one of {CPU_KERNEL_MODES}, got {mode!r}")
    if mode == "off" or device.type != "cpu":
        return TorchLayerOps()
    if cpu_kernels.available():
        # Said at load, so a deployment's logs show which path its workers run (the
        # container images build the kernels too: tests/e2e/test_compose.py reads this line).
        log.info("C++ CPU kernels loaded (%s: %s)", cpu_ext.active_isa().name, cpu_ext.library_path().name)
        return CpuKernelLayerOps()
    reason = cpu_ext.unavailable_reason()
    if mode == "on":
        raise RuntimeError(f"cpu_kernels=on but the C++ CPU kernels are unavailable: {reason}")
    log.warning("C++ CPU kernels unavailable (%s); using the slower torch ops", reason)
    return TorchLayerOps()
