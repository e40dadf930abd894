"""Paged decode attention in Triton (reference: kernels.torch_ops.paged_decode_attention_torch).

One program per (sequence, KV head) serves all `group = Hq // Hkv` query heads that share that
KV head, so each K/V row is read from memory once. The program walks the sequence in blocks of
BLOCK_N tokens; each token's page comes from the page table, so blocks may span pages and pages
may sit anywhere in the pool. Softmax is the streaming (online) form in fp32: a running max and
denominator per query head, the accumulator rescaled whenever the max grows. Page-table entries
past the last token are never loaded (every load is masked by the sequence length).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_launch import check_launchable

# Each tl.dot dimension is padded to at least 16, the smallest tile every GPU generation's dot
# lowering handles; padded query rows are masked out (decode is memory-bound, so idle rows cost
# arithmetic, not memory traffic).
_MIN_DOT = 16


@triton.jit
def _paged_decode_kernel(q_ptr, buffer_ptr, page_table_ptr, seq_lens_ptr, out_ptr,
                         scale, layer_offset,
                         stride_qb, stride_qh, stride_qd, stride_ob, stride_oh,
                         stride_table, stride_table_col, stride_page, stride_kv, stride_slot, stride_head,
                         GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_G)                   # query heads of this KV head (padded)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    q_heads = kv_head * GROUP + rows
    q = tl.load(q_ptr + seq * stride_qb + q_heads[:, None] * stride_qh + dims[None, :] * stride_qd,
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)

    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)   # running max of the scores
    l_i = tl.zeros((BLOCK_G,), tl.float32)                  # running softmax denominator
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    table_row = page_table_ptr + seq.to(tl.int64) * stride_table
    head_offset = layer_offset + kv_head * stride_head

    for start in range(0, seq_len, BLOCK_N):
        tokens = start + tl.arange(0, BLOCK_N)
        token_ok = tokens < seq_len
        pages = tl.load(table_row + (tokens // PAGE_SIZE) * stride_table_col, mask=token_ok,
                        other=0).to(tl.int64)
        row_base = pages * stride_page + (tokens % PAGE_SIZE) * stride_slot + head_offset
        kv_mask = token_ok[:, None] & dim_ok[None, :]
        k_ptrs = buffer_ptr + row_base[:, None] + dims[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(k_ptrs + stride_kv, mask=kv_mask, other=0.0).to(tl.float32)

        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale     # [BLOCK_G, BLOCK_N]
        scores = tl.where(token_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new

    # A zero-length sequence never entered the loop: acc is 0 and so is its output.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + seq * stride_ob + q_heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def paged_decode_attention_triton(q: torch.Tensor, buffer: torch.Tensor, layer: int,
                                  page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                                  block_n: int = 64) -> torch.Tensor:
    """Triton version of paged_decode_attention; `block_n` is the number of tokens per loop step."""
    if buffer.dim() != 6 or not buffer.is_contiguous():
        raise ValueError(f"expected a contiguous 6-d KV pool, got shape {tuple(buffer.shape)}")
    batch, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = buffer.shape[3], buffer.shape[4]
    if num_q_heads % num_kv_heads or head_dim != buffer.shape[5]:
        raise ValueError(f"q heads {num_q_heads} x dim {head_dim} do not fit KV heads {num_kv_heads} "
                         f"x dim {buffer.shape[5]}")
    # Metadata built on the host moves once here; a no-op when it already lives on the GPU.
    page_table = page_table.to(buffer.device, non_blocking=True)
    seq_lens = seq_lens.to(buffer.device, non_blocking=True).contiguous()
    check_launchable(q, buffer, page_table, seq_lens)
    group = num_q_heads // num_kv_heads
    out = torch.empty((batch, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    _paged_decode_kernel[(batch, num_kv_heads)](
        q, buffer, page_table, seq_lens, out, float(scale), layer * buffer.stride(1),
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1),
        page_table.stride(0), page_table.stride(1),
        buffer.stride(0), buffer.stride(2), buffer.stride(3), buffer.stride(4),
        GROUP=group, PAGE_SIZE=page_size, HEAD_DIM=head_dim,
        BLOCK_G=max(_MIN_DOT, triton.next_power_of_2(group)),
        BLOCK_D=max(_MIN_DOT, triton.next_power_of_2(head_dim)),
        BLOCK_N=max(_MIN_DOT, triton.next_power_of_2(block_n)))
    return out
