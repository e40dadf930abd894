"""Triton kernels that move K/V in and out of the page-major pool (see kernels.torch_ops for references).

The pool `buffer[page, layer, k_or_v, offset, kv_head, dim]` must be contiguous: within one
(page, layer, k_or_v, offset) slot the Hkv * D values are consecutive, so each token moves as
one contiguous run, and a whole page is one contiguous block. Page ids and slots are widened to
int64 before any address arithmetic: page * page_stride overflows int32 on pools above 2 GiB.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_launch import check_launchable

# Elements one program copies per launch-grid cell (a token's Hkv * D values, or a page chunk).
_TOKEN_BLOCK = 1024
_PAGE_BLOCK = 4096


@triton.jit
def _store_kv_kernel(buffer_ptr, slots_ptr, k_ptr, v_ptr, layer_offset,
                     stride_page, stride_kv, stride_slot,
                     stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
                     PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, TOKEN_ELEMS: tl.constexpr,
                     BLOCK: tl.constexpr):
    token = tl.program_id(0)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < TOKEN_ELEMS
    head = idx // HEAD_DIM
    dim = idx % HEAD_DIM
    slot = tl.load(slots_ptr + token).to(tl.int64)
    page = slot // PAGE_SIZE
    dst = buffer_ptr + page * stride_page + layer_offset + (slot % PAGE_SIZE) * stride_slot + idx
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + dim * stride_kd, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + dim * stride_vd, mask=mask)
    tl.store(dst, k.to(buffer_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_kv, v.to(buffer_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gather_kv_kernel(buffer_ptr, page_ids_ptr, k_out_ptr, v_out_ptr, layer_offset,
                      stride_page, stride_kv, stride_slot,
                      PAGE_SIZE: tl.constexpr, TOKEN_ELEMS: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < TOKEN_ELEMS
    page = tl.load(page_ids_ptr + token // PAGE_SIZE).to(tl.int64)
    src = buffer_ptr + page * stride_page + layer_offset + (token % PAGE_SIZE) * stride_slot + idx
    out = token.to(tl.int64) * TOKEN_ELEMS + idx
    tl.store(k_out_ptr + out, tl.load(src, mask=mask), mask=mask)
    tl.store(v_out_ptr + out, tl.load(src + stride_kv, mask=mask), mask=mask)


@triton.jit
def _copy_pages_kernel(src_ptr, dst_ptr, page_ids_ptr, PAGE_ELEMS: tl.constexpr,
                       GATHER: tl.constexpr, BLOCK: tl.constexpr):
    """GATHER: dst[i] = src[page_ids[i]]; otherwise (scatter) dst[page_ids[i]] = src[i]."""
    i = tl.program_id(0).to(tl.int64)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < PAGE_ELEMS
    page = tl.load(page_ids_ptr + i).to(tl.int64)
    if GATHER:
        src_base = page * PAGE_ELEMS
        dst_base = i * PAGE_ELEMS
    else:
        src_base = i * PAGE_ELEMS
        dst_base = page * PAGE_ELEMS
    tl.store(dst_ptr + dst_base + idx, tl.load(src_ptr + src_base + idx, mask=mask), mask=mask)


def _check_pool(buffer: torch.Tensor) -> None:
    if buffer.dim() != 6 or not buffer.is_contiguous():
        raise ValueError(f"expected a contiguous [pages, layers, 2, page_size, kv_heads, head_dim] pool, "
                         f"got shape {tuple(buffer.shape)} strides {buffer.stride()}")


def store_kv_triton(buffer: torch.Tensor, layer: int, slots: torch.Tensor,
                    k: torch.Tensor, v: torch.Tensor) -> None:
    """Triton version of kernels.torch_ops.store_kv_torch."""
    _check_pool(buffer)
    slots = slots.to(device=buffer.device, dtype=torch.long).contiguous()
    check_launchable(buffer, slots, k, v)
    num_tokens = slots.numel()
    if num_tokens == 0:
        return
    page_size, num_kv_heads, head_dim = buffer.shape[3:]
    token_elems = num_kv_heads * head_dim
    block = min(_TOKEN_BLOCK, triton.next_power_of_2(token_elems))
    grid = (num_tokens, triton.cdiv(token_elems, block))
    _store_kv_kernel[grid](
        buffer, slots, k, v, layer * buffer.stride(1),
        buffer.stride(0), buffer.stride(2), buffer.stride(3),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        PAGE_SIZE=page_size, HEAD_DIM=head_dim, TOKEN_ELEMS=token_elems, BLOCK=block)


def gather_kv_triton(buffer: torch.Tensor, layer: int, page_ids: torch.Tensor,
                     num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of kernels.torch_ops.gather_kv_torch."""
    _check_pool(buffer)
    page_size, num_kv_heads, head_dim = buffer.shape[3:]
    if -(-num_tokens // page_size) > len(page_ids):
        raise ValueError(f"{num_tokens} tokens need {-(-num_tokens // page_size)} pages, "
                         f"got {len(page_ids)} page ids")
    page_ids = page_ids.to(device=buffer.device, dtype=torch.long).contiguous()
    check_launchable(buffer, page_ids)
    k = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=buffer.dtype, device=buffer.device)
    v = torch.empty_like(k)
    if num_tokens == 0:
        return k, v
    token_elems = num_kv_heads * head_dim
    block = min(_TOKEN_BLOCK, triton.next_power_of_2(token_elems))
    grid = (num_tokens, triton.cdiv(token_elems, block))
    _gather_kv_kernel[grid](
        buffer, page_ids, k, v, layer * buffer.stride(1),
        buffer.stride(0), buffer.stride(2), buffer.stride(3),
        PAGE_SIZE=page_size, TOKEN_ELEMS=token_elems, BLOCK=block)
    return k, v


def _launch_copy_pages(src: torch.Tensor, dst: torch.Tensor, page_ids: torch.Tensor, gather: bool) -> None:
    if page_ids.numel() == 0:
        return
    page_elems = src[0].numel()
    block = min(_PAGE_BLOCK, triton.next_power_of_2(page_elems))
    grid = (page_ids.numel(), triton.cdiv(page_elems, block))
    _copy_pages_kernel[grid](src, dst, page_ids, PAGE_ELEMS=page_elems, GATHER=gather, BLOCK=block)


def gather_pages_triton(buffer: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """Triton version of kernels.torch_ops.gather_pages_torch."""
    _check_pool(buffer)
    page_ids = page_ids.to(device=buffer.device, dtype=torch.long).contiguous()
    check_launchable(buffer, page_ids)
    out = torch.empty((page_ids.numel(), *buffer.shape[1:]), dtype=buffer.dtype, device=buffer.device)
    _launch_copy_pages(buffer, out, page_ids, gather=True)
    return out


def scatter_pages_triton(buffer: torch.Tensor, page_ids: torch.Tensor, src: torch.Tensor) -> None:
    """Triton version of kernels.torch_ops.scatter_pages_torch (src must be on the pool's device)."""
    _check_pool(buffer)
    page_ids = page_ids.to(device=buffer.device, dtype=torch.long).contiguous()
    if src.shape != (page_ids.numel(), *buffer.shape[1:]):
        raise ValueError(f"src shape {tuple(src.shape)} does not match {page_ids.numel()} pages of "
                         f"{tuple(buffer.shape[1:])}")
    src = src.to(dtype=buffer.dtype).contiguous()
    check_launchable(buffer, page_ids, src)
    _launch_copy_pages(src, buffer, page_ids, gather=False)
