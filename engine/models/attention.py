"""Attention over the paged KV pool for one flattened batch of decode tokens and extend chunks.

The batch's rows are laid out as: first `num_decode` decode tokens (one per sequence), then each
extend span's new tokens back to back. Decode rows go through one batched decode op (the engine's
choice: the C++ kernel that reads the pages, or `kernels.ops.paged_decode_attention`); each extend
span attends to its cached prefix plus causally over its own new tokens, by one extend op per span
(the engine's choice again: the C++ kernel that reads the pages, or torch SDPA over the gathered
pages).

Both decode paths compute a sequence's attention from that sequence alone, in an order that does
not depend on the rest of the batch, so that a request's greedy tokens need not depend on the load
it is served under (tests/engine/test_batch_invariance.py). This is why there is no padded-batch
decode path: padding every sequence to the longest one was faster for the torch ops on CPU, but
changed each sequence's sums with its neighbours' lengths.
"""

from __future__ import annotations

import functools
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

    @functools.cached_property
    def mask(self) -> torch.Tensor | None:
        # Built on first use, then shared by every layer of the step: only the torch SDPA path
        # reads it (the C++ kernel masks by position), and at long contexts it is length x
        # (prefix + length) bytes per chunk.
        return extend_mask(self.prefix_len, self.length, self.page_ids.device)


@dataclass
class AttentionMetadata:
    """Per-step attention inputs shared by every layer; built once by the model runner."""

    slots: torch.Tensor  # [T] pool slot (page * page_size + offset) of each row's new K/V
    num_decode: int
    decode_page_table: torch.Tensor | None  # [num_decode, max_pages]
    decode_seq_lens: torch.Tensor | None  # [num_decode], including the token being decoded
    extends: list[ExtendSpan]

    def decode_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(decode_page_table, decode_seq_lens), for a step with decode rows (the runner sets both then)."""
        if self.decode_page_table is None or self.decode_seq_lens is None:
            raise ValueError("decode attention over a step without its decode tables "
                             f"({self.num_decode} decode rows)")
        return self.decode_page_table, self.decode_seq_lens


# decode_op(q, buffer, layer, page_table, seq_lens, scale): kernels.ops.paged_decode_attention's contract.
DecodeOp = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor, float], torch.Tensor]


def decode_attention(q: torch.Tensor, buffer: torch.Tensor, layer: int, meta: AttentionMetadata,
                     scale: float, decode_op: DecodeOp = ops.paged_decode_attention) -> torch.Tensor:
    page_table, seq_lens = meta.decode_tables()
    return decode_op(q, buffer, layer, page_table, seq_lens, scale)


def extend_mask(prefix_len: int, length: int, device: torch.device) -> torch.Tensor | None:
    """Row i (absolute position prefix_len + i) may see keys 0..prefix_len + i."""
    if prefix_len == 0:
        return None
    keys = torch.arange(prefix_len + length, device=device)
    queries = torch.arange(length, device=device) + prefix_len
    return keys[None, :] <= queries[:, None]


def extend_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, buffer: torch.Tensor,
                           layer: int, span: ExtendSpan, scale: float) -> torch.Tensor:
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
ExtendOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, ExtendSpan, float],
                    torch.Tensor]


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
