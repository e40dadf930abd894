"""Attention over the paged KV pool for one flattened batch of decode tokens and extend chunks.

The batch's rows are laid out as: first `num_decode` decode tokens (one per sequence), then each
extend span's new tokens back to back. Decode rows go through one batched decode op (the engine's
choice: the C++ kernel that reads the pages, or `kernels.ops.paged_decode_attention`, or on CPU
when the sequences have similar lengths the padded batch below); each extend span attends to its
cached prefix plus causally over its own new tokens, by one extend op per span (the engine's
choice again: the C++ kernel that reads the pages, or torch SDPA over the gathered pages).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import ops


@dataclass
class ExtendSpan:
    """`length` new tokens of one sequence at rows [start, start+length), after `prefix_len` cached ones.

    `page_ids` covers prefix_len + length tokens. `mask` ([length, prefix_len + length] bool, True
    = may attend) is None when there is no prefix (plain causal attention over the new tokens).
    """

    start: int
    length: int
    prefix_len: int
    page_ids: torch.Tensor
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    """Per-step attention inputs shared by every layer; built once by the model runner."""

    slots: torch.Tensor  # [T] pool slot (page * page_size + offset) of each row's new K/V
    num_decode: int
    decode_page_table: torch.Tensor | None  # [num_decode, max_pages]
    decode_seq_lens: torch.Tensor | None  # [num_decode], including the token being decoded
    extends: list[ExtendSpan]
    decode_padded: PaddedDecode | None = None  # set when the padded CPU path is used


@dataclass
class PaddedDecode:
    """Decode batch padded to its longest sequence: `page_ids` [B * pages] (short rows padded
    with page 0) and `mask` [B, 1, 1, pages * page_size] (True = a real key)."""

    page_ids: torch.Tensor
    mask: torch.Tensor
    num_pages: int


# Padding waste up to which the padded batch beats kernels.ops' per-sequence CPU loop. Measured
# (2 threads, 16 sequences, 12/4 heads, head_dim 64): equal lengths ~170, padded SDPA 0.51 ms
# vs 0.95 ms per layer; lengths uniform in 100..700 (1.7x padding), the per-sequence loop wins.
MAX_PADDING_RATIO = 1.25


def padded_decode(seq_lens: list[int], page_tables: list[list[int]], page_size: int,
                  device: torch.device) -> PaddedDecode | None:
    """The padded-batch plan for a CPU decode batch, or None when padding would waste too much."""
    longest = max(seq_lens)
    if device.type != "cpu" or longest * len(seq_lens) > MAX_PADDING_RATIO * sum(seq_lens):
        return None
    num_pages = -(-longest // page_size)
    ids = [pages[:num_pages] + [0] * (num_pages - len(pages[:num_pages])) for pages in page_tables]
    lens = torch.tensor(seq_lens)
    mask = torch.arange(num_pages * page_size)[None, :] < lens[:, None]
    return PaddedDecode(page_ids=torch.tensor(ids).view(-1), mask=mask[:, None, None, :], num_pages=num_pages)


def _padded_decode_attention(q: torch.Tensor, buffer: torch.Tensor, layer: int, plan: PaddedDecode,
                             scale: float) -> torch.Tensor:
    # One page gather per K and V into [B, Hkv, len, D] views, then SDPA with the `group` query
    # heads of a KV head as its query rows: no K/V repeat for GQA, no Python loop per sequence.
    batch, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = buffer.shape[3], buffer.shape[4]
    length = plan.num_pages * page_size
    k = buffer[:, layer, 0].index_select(0, plan.page_ids).view(batch, length, num_kv_heads, head_dim)
    v = buffer[:, layer, 1].index_select(0, plan.page_ids).view(batch, length, num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        q.view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim),
        k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype), attn_mask=plan.mask, scale=scale)
    return out.reshape(batch, num_q_heads, head_dim)


# decode_op(q, buffer, layer, page_table, seq_lens, scale): kernels.ops.paged_decode_attention's contract.
DecodeOp = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor, float], torch.Tensor]


def decode_attention(q: torch.Tensor, buffer: torch.Tensor, layer: int, meta: AttentionMetadata,
                     scale: float, decode_op: DecodeOp = ops.paged_decode_attention) -> torch.Tensor:
    if meta.decode_padded is not None:
        return _padded_decode_attention(q, buffer, layer, meta.decode_padded, scale)
    return decode_op(q, buffer, layer, meta.decode_page_table, meta.decode_seq_lens, scale)


def extend_mask(prefix_len: int, length: int, device: torch.device) -> torch.Tensor | None:
    """Row i (absolute position prefix_len + i) may see keys 0..prefix_len + i."""
    if prefix_len == 0:
        return None
    keys = torch.arange(prefix_len + length, device=device)
    queries = torch.arange(length, device=device) + prefix_len
    return keys[None, :] <= queries[:, None]


def extend_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, buffer: torch.Tensor, layer: int,
                           span: ExtendSpan, scale: float) -> torch.Tensor:
    """One span's attention by torch SDPA over its K/V gathered from the pages: q [L, Hq, D], the
    span's own k/v [L, Hkv, D] -> [L, Hq, D]. The reference the C++ kernel is tested against."""
    if span.prefix_len == 0:
        # The chunk's own K/V are exactly what was just stored: skip the round trip via pages.
        keys, values = k, v
    else:
        keys, values = ops.gather_kv(buffer, layer, span.page_ids, span.prefix_len + span.length)
    attended = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys.transpose(0, 1).unsqueeze(0).to(q.dtype),
        values.transpose(0, 1).unsqueeze(0).to(q.dtype),
        attn_mask=span.mask, is_causal=span.mask is None, scale=scale, enable_gqa=True)
    return attended[0].transpose(0, 1)


# extend_op(q, k, v, buffer, layer, span, scale): extend_attention_torch's contract, rows of one span.
ExtendOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, ExtendSpan, float], torch.Tensor]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, buffer: torch.Tensor,
                    layer: int, meta: AttentionMetadata, scale: float,
                    decode_op: DecodeOp = ops.paged_decode_attention,
                    extend_op: ExtendOp = extend_attention_torch) -> torch.Tensor:
    """q [T, Hq, D], this step's k/v [T, Hkv, D] (already stored in the pool) -> [T, Hq, D]."""
    num_decode = meta.num_decode
    if num_decode and not meta.extends:
        return decode_attention(q, buffer, layer, meta, scale, decode_op)
    if not num_decode and len(meta.extends) == 1 and meta.extends[0].length == q.shape[0]:
        # One prompt chunk alone (the usual prefill step): no copy into `out` when the op's result
        # is already contiguous (the C++ kernel's is; torch SDPA's is transposed).
        return extend_op(q, k, v, buffer, layer, meta.extends[0], scale).contiguous()
    out = torch.empty_like(q)
    if num_decode:
        out[:num_decode] = decode_attention(q[:num_decode], buffer, layer, meta, scale, decode_op)
    for span in meta.extends:
        rows = slice(span.start, span.start + span.length)
        out[rows] = extend_op(q[rows], k[rows], v[rows], buffer, layer, span, scale)
    return out
