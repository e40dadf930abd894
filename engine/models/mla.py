"""Multi-head latent attention (DeepSeek V2/V3) over a KV pool that stores the compressed latent.

Per token, MLA projects the hidden state to a `kv_lora_rank` latent (kv_a_proj_with_mqa, then
kv_a_layernorm) and one rope key of `qk_rope_head_dim` shared by every head; each head's key and
value are linear in the latent (kv_b_proj). The pool keeps only [latent | rotated rope key] per
token and layer (libkv.layout's MLA layout), the same rows on every tensor-parallel rank.

Attention runs in the "absorbed" form: a head's q_nope goes through that head's K half of
kv_b_proj once, giving a query in latent space, so that

    score(t, s) = (W_uk^T q_nope) . latent_s + q_pe . k_pe_s = q . k (as transformers computes it)
    output      = W_uv (sum_s p(t, s) latent_s)                = sum_s p(t, s) v_s

which is multi-query attention with keys [latent | k_pe] and values `latent`, read straight from
the pool rows: no per-head K or V is ever built for the cached tokens. Each sequence (a decode row
or an extend span) attends over its own rows alone by torch SDPA, in an order that does not depend
on the rest of the batch, and decode rows take the same per-sequence path as prompt chunks. On CPU
with the C++ kernels built, the engine runs the same arithmetic as one fused op over the whole batch
(kernels/csrc/mla_attention.cpp, through engine.models.layer_ops): per (row, head), reading the pool
pages directly, with every sum in an order fixed by the row's sequence and position; `attend_torch`
below stays the reference it is tested against and the path for cpu_kernels=off and other devices.

From the absorbed query to the per-head values everything runs in fp32 (as the engine's torch decode
attention does), rounded to the model dtype once, before o_proj; kv_b_proj's halves are kept in
fp32 for that (in a bf16 model, twice their checkpoint size). In fp32 this form gives
transformers' greedy tokens with logprobs within about 1e-4 (tests/engine/test_mla.py). In bf16
the rounding points necessarily differ from transformers' expanded form (which rounds each head's K
and V): measured against HF bf16, at most 0.25 in a logprob with this fp32 attention, 0.45 with the
attention in bf16, 0.12 for the expanded form, while HF bf16 itself is up to 0.9 from HF fp32 on the
same tokens (tiny V3 checkpoint of the tests). The expanded form would rebuild every cached token's
K and V per layer and step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.models.attention import AttentionMetadata, extend_mask
from engine.models.layer_ops import rms_norm
from engine.models.linear import Linear
from engine.models.mla_config import MLAConfig
from engine.models.rope import (
    RotaryTable,
    apply_rotary,
    apply_rotary_complex,
    apply_rotary_interleaved,
    mla_softmax_scale,
)
from engine.models.weights import ShardedReader

# q_a_layernorm and kv_a_layernorm are built with transformers' default eps, not rms_norm_eps.
_LATENT_NORM_EPS = 1e-6
# attend(mla_attention, q_nope, q_pe, rows, buffer, layer, meta) -> [T, H, v_head_dim]: attend_torch's
# contract.
MLAAttendOp = Callable[["MLAAttention", torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int,
                        AttentionMetadata], torch.Tensor]
_ROTATIONS = {"complex": apply_rotary_complex, "interleave": apply_rotary_interleaved, "half": apply_rotary}


class MLARope:
    """The rope of an MLA model's qk_rope_head_dim part, shared by all its layers.

    DeepSeek-V2 rotates in fp32 (its table stays fp32); V3 in the model dtype, as transformers does.
    """

    def __init__(self, config, dtype: torch.dtype, device: torch.device) -> None:
        mla: MLAConfig = config.mla
        self.rotate = _ROTATIONS[mla.rope_style]
        table_dtype = torch.float32 if mla.rope_style == "complex" else dtype
        self.table = RotaryTable(config.rope, mla.qk_rope_head_dim, config.max_position_embeddings,
                                 table_dtype, device)

    def __call__(self, q_pe: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor,
                 max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q_pe [T, H, R], k_pe [T, 1, R] rotated to their positions."""
        cos, sin = self.table.lookup(positions, max_position)
        return self.rotate(q_pe, cos, sin), self.rotate(k_pe, cos, sin)


class MLAAttention:
    """One layer's MLA; __call__ stores this step's latent rows and returns this rank's partial
    o_proj output [T, hidden].

    Under tensor parallelism a rank holds its heads' rows of q_b_proj (or q_proj) and kv_b_proj and
    their columns of o_proj; q_a_proj, kv_a_proj_with_mqa and the two norms are replicated, so every
    rank computes (and stores in its own pool) the same latent.
    """

    def __init__(self, mla: MLAConfig, num_heads: int, scale: float, rope: MLARope,
                 q_proj: Linear | None, q_a_proj: Linear | None, q_a_norm: torch.Tensor | None,
                 q_b_proj: Linear | None, kv_a_proj: Linear, kv_a_norm: torch.Tensor,
                 k_up: torch.Tensor, v_up: torch.Tensor, o_proj: Linear) -> None:
        self.mla = mla
        self.num_heads = num_heads  # this rank's
        self.scale = scale
        self.rope = rope
        self.q_proj, self.q_a_proj, self.q_a_norm, self.q_b_proj = q_proj, q_a_proj, q_a_norm, q_b_proj
        self.kv_a_proj = kv_a_proj
        self.kv_a_norm = kv_a_norm
        # kv_b_proj's K and V rows per head, kept in fp32 (the attention's compute dtype).
        self.k_up = k_up.float().contiguous()  # [H, qk_nope, kv_lora_rank]
        self.v_up_t = v_up.transpose(1, 2).float().contiguous()  # [H, kv_lora_rank, v_head_dim]
        self.o_proj = o_proj

    @classmethod
    def load(cls, weights: ShardedReader, attn_prefix: str, config,
             rope: MLARope | None = None) -> MLAAttention:
        """`rope` is shared by the model's layers (DecoderModel builds one); None builds one for this
        layer."""
        mla: MLAConfig = config.mla
        hidden, heads = config.hidden_size, config.num_heads
        local_heads = heads // weights.tp_size
        p = attn_prefix

        def bias(name: str, rows: int) -> torch.Tensor | None:
            return weights.get(p + name + ".bias", (rows,)) if mla.attention_bias else None

        q_rows = heads * mla.qk_head_dim
        q_proj = q_a_proj = q_a_norm = q_b_proj = None
        if mla.q_lora_rank is None:
            q_proj = Linear(weights.rows(weights.get(p + "q_proj.weight", (q_rows, hidden))))
        else:
            rank = mla.q_lora_rank
            q_a_proj = Linear(weights.get(p + "q_a_proj.weight", (rank, hidden)), bias("q_a_proj", rank))
            q_a_norm = weights.get(p + "q_a_layernorm.weight", (rank,))
            q_b_proj = Linear(weights.rows(weights.get(p + "q_b_proj.weight", (q_rows, rank))))
        latent_rows = mla.kv_lora_rank + mla.qk_rope_head_dim
        kv_a_proj = Linear(weights.get(p + "kv_a_proj_with_mqa.weight", (latent_rows, hidden)),
                           bias("kv_a_proj_with_mqa", latent_rows))
        kv_a_norm = weights.get(p + "kv_a_layernorm.weight", (mla.kv_lora_rank,))
        kv_b = weights.rows(weights.get(p + "kv_b_proj.weight",
                                        (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank)))
        kv_b = kv_b.view(local_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        k_up, v_up = kv_b.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)
        o_proj = Linear(weights.columns(weights.get(p + "o_proj.weight", (hidden, heads * mla.v_head_dim))),
                        weights.row_bias(bias("o_proj", hidden)))
        if rope is None:
            rope = MLARope(config, weights.dtype, weights.device)
        return cls(mla, local_heads, mla_softmax_scale(config.rope, mla.qk_head_dim), rope, q_proj, q_a_proj,
                   q_a_norm, q_b_proj, kv_a_proj, kv_a_norm, k_up, v_up, o_proj)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, max_position: int, buffer: torch.Tensor,
                 layer: int, meta: AttentionMetadata, attend: MLAAttendOp | None = None) -> torch.Tensor:
        """`attend` is the engine's choice of attention op (engine.models.layer_ops: the C++ kernel or
        `attend_torch`); None means `attend_torch`."""
        mla, heads = self.mla, self.num_heads
        tokens = x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        elif self.q_a_proj is not None and self.q_a_norm is not None and self.q_b_proj is not None:
            q = self.q_b_proj(rms_norm(self.q_a_proj(x), self.q_a_norm, _LATENT_NORM_EPS))
        else:
            raise ValueError("an MLA layer needs q_proj, or q_a_proj, q_a_layernorm and q_b_proj")
        q_nope, q_pe = q.view(tokens, heads, mla.qk_head_dim).split(
            [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = rms_norm(latent, self.kv_a_norm, _LATENT_NORM_EPS)
        q_pe, k_pe = self.rope(q_pe, k_pe.unsqueeze(1), positions, max_position)
        rows = torch.cat([latent, k_pe.squeeze(1)], dim=-1)  # [T, kv_lora_rank + rope]: what the pool holds
        store_latent(buffer, layer, meta.slots, rows)

        out = attend(self, q_nope, q_pe, rows, buffer, layer, meta) if attend else self.attend_torch(
            q_nope, q_pe, rows, buffer, layer, meta)
        return self.o_proj(out.view(tokens, heads * mla.v_head_dim))

    def attend_torch(self, q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor, buffer: torch.Tensor,
                     layer: int, meta: AttentionMetadata) -> torch.Tensor:
        """The batch's attention [T, H, v_head_dim] in the model dtype, sequence by sequence: the
        reference (and the path off CPU) of the C++ kernel kernels.cpu_kernels.mla_attention."""
        out = torch.empty(*q_nope.shape[:2], self.mla.v_head_dim, dtype=q_nope.dtype, device=q_nope.device)
        if meta.num_decode:
            page_table, seq_lens = meta.decode_tables()
            for b, length in enumerate(seq_lens.tolist()):
                keys = gather_latent(buffer, layer, page_table[b], length)
                out[b:b + 1] = self._attend(q_nope[b:b + 1], q_pe[b:b + 1], keys, length - 1)
        for span in meta.extends:
            span_rows = slice(span.start, span.start + span.length)
            if span.prefix_len == 0:
                keys = rows[span_rows]  # exactly what was just stored: skip the round trip via pages
            else:
                keys = gather_latent(buffer, layer, span.page_ids, span.prefix_len + span.length)
            out[span_rows] = self._attend(q_nope[span_rows], q_pe[span_rows], keys, span.prefix_len,
                                          span.mask)
        return out

    def _attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, keys: torch.Tensor, prefix_len: int,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """One sequence: L new tokens' q_nope [L, H, nope] and rotated q_pe [L, H, rope], after
        prefix_len cached ones, over its pool rows keys [prefix_len + L, C] -> [L, H, v_head_dim].

        Per sequence, because a batched matmul's row sums change with its row count (measured:
        bmm rows differed from 5 rows up), and a request's output must not depend on its batch.
        """
        length, rank = q_nope.shape[0], self.mla.kv_lora_rank
        # The query in latent space, per head: [H, L, kv_lora_rank + rope], fp32.
        query = torch.cat([torch.bmm(q_nope.transpose(0, 1).float(), self.k_up),
                           q_pe.transpose(0, 1).float()], dim=-1)
        if length > 1 and prefix_len and mask is None:
            mask = extend_mask(prefix_len, length, query.device)
        keys = keys.float()[None, None]
        latent_out = F.scaled_dot_product_attention(
            query.unsqueeze(0), keys, keys[..., :rank], attn_mask=mask, is_causal=length > 1 and mask is None,
            scale=self.scale, enable_gqa=True)[0]  # [H, L, kv_lora_rank]
        return torch.bmm(latent_out, self.v_up_t).transpose(0, 1).to(q_nope.dtype)


def _latent_rows(buffer: torch.Tensor) -> torch.Tensor:
    """The MLA pool [pages, layers, 1, page_size, 1, C] as rows of one token's C values."""
    return buffer.view(-1, buffer.shape[-1])


def store_latent(buffer: torch.Tensor, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Write T tokens' [latent | k_pe] rows ([T, C]) into their `slots` of `layer`."""
    num_layers, page_size = buffer.shape[1], buffer.shape[3]
    slots = slots.to(device=buffer.device, dtype=torch.long)
    pages = torch.div(slots, page_size, rounding_mode="floor")
    row_ids = (pages * num_layers + layer) * page_size + (slots - pages * page_size)
    _latent_rows(buffer).index_copy_(0, row_ids, rows.to(buffer.dtype))


def gather_latent(buffer: torch.Tensor, layer: int, page_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The [latent | k_pe] rows [num_tokens, C] of a sequence's first `num_tokens` tokens in `layer`."""
    num_layers, page_size, width = buffer.shape[1], buffer.shape[3], buffer.shape[-1]
    num_pages = -(-num_tokens // page_size)
    ids = page_ids[:num_pages].to(device=buffer.device, dtype=torch.long)
    blocks = buffer.view(-1, page_size * width)  # one (page, layer) block per row
    return blocks.index_select(0, ids * num_layers + layer).view(-1, width)[:num_tokens]
