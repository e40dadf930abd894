"""Triton kernels of the batched LoRA product (engine.lora.ops's slot layout, `lora_delta_reference` the
reference): each row adds its own adapter's delta to a projection's output, in two launches.

- shrink: hidden[t, w] = scales[s] * A[s*W + w] . x[t] for s = row_slots[t] (0 for s = -1), over the
  slot's rows only: a [T, W] product however many slots the pool has.
- expand: out[t, n] += sum_j hidden[t, m*R + j] * Bt[s*W + m*R + j, n] for the R rank rows of the
  sub-module m whose output columns [bounds[m], bounds[m+1]) hold n: the zero blocks of a fused
  projection's B are never read.

A program handles one row and one block of columns, so rows of different adapters share a launch
with no sorting and no per-row weight copies; each row's sums run in one fixed order whatever the
batch. Sums in fp32; `out` is updated in place, rows of the base model (slot -1) are not written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_launch import check_launchable

_BLOCK_K = 64  # input features per shrink loop step
_BLOCK_W = 16  # LoRA columns per shrink program
_BLOCK_N = 64  # output features per expand program
_BLOCK_R = 16  # rank rows per expand loop step


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, scales_ptr, hidden_ptr, IN, WIDTH,
                   BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    column_mask = columns < WIDTH
    slot = tl.load(slots_ptr + row)
    acc = tl.zeros((BLOCK_W,), dtype=tl.float32)
    if slot >= 0:
        a_rows = slot * WIDTH + columns.to(tl.int64)
        for k in range(0, IN, BLOCK_K):
            ks = k + tl.arange(0, BLOCK_K)
            k_mask = ks < IN
            x = tl.load(x_ptr + row * IN + ks, mask=k_mask, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + a_rows[:, None] * IN + ks[None, :],
                        mask=column_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
        acc = acc * tl.load(scales_ptr + slot)
    tl.store(hidden_ptr + row * WIDTH + columns, acc, mask=column_mask)


@triton.jit
def _expand_kernel(hidden_ptr, bt_ptr, slots_ptr, bounds_ptr, out_ptr, OUT, WIDTH, RANK, MODULES,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row)
    if slot >= 0:
        ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = ns < OUT
        # the sub-module of each output column: how many module starts after the first are <= it
        module = tl.zeros((BLOCK_N,), dtype=tl.int64)
        for m in range(1, MODULES):
            module += (ns >= tl.load(bounds_ptr + m)).to(tl.int64)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for j in range(0, RANK, BLOCK_R):
            rs = j + tl.arange(0, BLOCK_R)
            r_mask = rs < RANK
            columns = module[None, :] * RANK + rs[:, None]  # [BLOCK_R, BLOCK_N] LoRA column per lane
            mask = r_mask[:, None] & n_mask[None, :]
            h = tl.load(hidden_ptr + row * WIDTH + columns, mask=mask, other=0.0)
            bt = tl.load(bt_ptr + (slot * WIDTH + columns) * OUT + ns[None, :], mask=mask, other=0.0)
            acc += tl.sum(h * bt.to(tl.float32), axis=0)
        dst = out_ptr + row * OUT + ns
        base = tl.load(dst, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(dst, (base + acc).to(out_ptr.dtype.element_ty), mask=n_mask)


def lora_delta_add_triton(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                          row_slots: torch.Tensor, scales: torch.Tensor,
                          bounds: tuple[int, ...]) -> torch.Tensor:
    """out [T, out] += each row's delta (kernels.cpu_kernels.lora_delta_add's contract, less its
    per-slot ranks: rank rows past an adapter's rank are zeros in the pool) in place; returns out."""
    check_launchable(out, x, a, bt, row_slots, scales)
    num_slots, modules = scales.shape[0], len(bounds) - 1
    rows, in_features = x.shape
    width = a.shape[0] // num_slots
    if (not (x.is_contiguous() and a.is_contiguous() and bt.is_contiguous() and out.is_contiguous())
            or a.shape[1] != in_features or bt.shape != (a.shape[0], out.shape[1]) or out.shape[0] != rows
            or width % modules or bounds[0] != 0 or bounds[-1] != out.shape[1]):
        raise ValueError(f"expected contiguous x [T, in], a [S*W, in], bt [S*W, out], out [T, out] and "
                         f"bounds from 0 to out; got x {tuple(x.shape)}, a {tuple(a.shape)}, "
                         f"bt {tuple(bt.shape)}, out {tuple(out.shape)}, bounds {bounds}")
    if rows == 0:
        return out
    slots = row_slots.to(torch.int64)
    hidden = torch.empty(rows, width, dtype=torch.float32, device=x.device)
    _shrink_kernel[(rows, triton.cdiv(width, _BLOCK_W))](x, a, slots, scales.float(), hidden, in_features,
                                                         width, BLOCK_K=_BLOCK_K, BLOCK_W=_BLOCK_W)
    bounds_tensor = torch.tensor(bounds, dtype=torch.int64, device=x.device)
    _expand_kernel[(rows, triton.cdiv(out.shape[1], _BLOCK_N))](
        hidden, bt, slots, bounds_tensor, out, out.shape[1], width, width // modules, modules,
        BLOCK_N=_BLOCK_N, BLOCK_R=_BLOCK_R)
    return out
