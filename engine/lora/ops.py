"""The batched LoRA product: each row of a step adds its own adapter's delta, in one pass.

The slot pool (engine.lora.slots) keeps, per adapted projection, every resident adapter's A and B
side by side: `a` [S * W, in] (slot s's rows at s*W..) and `bt` [S * W, out] (B transposed, its
rows there), where W is the projection's LoRA width (its sub-modules times --max-lora-rank: q/k/v
fused are 3 of them, each with its own rank rows and its own output columns in Bt, so one product
covers the fused matrix). A row reads only its slot's block; base rows (slot -1) read none and get
an exact zero.

`lora_delta` is the torch path: one [T, S*W] product through all slots, masked to each row's slot
and scaled, then one product back through Bt. No Python loop over adapters or rows; the waste is
the other slots' columns, a few percent of a projection at decode ranks. `lora_delta_reference`
gathers each row's own A and Bt (the definition, for tests); the C++ kernel
(kernels/csrc/lora.cpp) and the Triton one (kernels/triton_lora.py) compute only each row's slot.
"""

from __future__ import annotations

import torch


def slot_mask(row_slots: torch.Tensor, scales: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, S * width]: row t's scaling on its slot's columns, 0 elsewhere (everywhere for slot -1)."""
    num_slots = scales.shape[0]
    column_slot = torch.arange(num_slots, device=row_slots.device).repeat_interleave(width)
    hit = row_slots.unsqueeze(1) == column_slot.unsqueeze(0)
    return (hit * scales[column_slot].unsqueeze(0)).to(dtype)


def lora_delta(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[T, out]: sum over each row's slot of scaling * Bt_s^T @ A_s @ x (mask from `slot_mask`)."""
    return torch.mm(torch.mm(x, a.t()) * mask, bt)


def lora_delta_reference(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, row_slots: torch.Tensor,
                         scales: torch.Tensor) -> torch.Tensor:
    """The same by gathering each row's own A [W, in] and Bt [W, out] (memory T * out * W: tests only)."""
    num_slots = scales.shape[0]
    width = a.shape[0] // num_slots
    used = row_slots.clamp(min=0)
    a_rows = a.view(num_slots, width, -1)[used].float()  # [T, W, in]
    bt_rows = bt.view(num_slots, width, -1)[used].float()  # [T, W, out]
    hidden = torch.bmm(a_rows, x.float().unsqueeze(2))  # [T, W, 1]
    out = torch.bmm(hidden.transpose(1, 2), bt_rows).squeeze(1)
    factor = torch.where(row_slots >= 0, scales[used], torch.zeros_like(scales[used]))
    return (out * factor.unsqueeze(1)).to(x.dtype)
