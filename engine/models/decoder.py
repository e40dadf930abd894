"""The one decoder-only transformer behind every supported checkpoint.

Each layer's attention is GQA (Llama, Qwen, Mixtral) or multi-head latent attention (DeepSeek,
engine.models.mla); each layer's MLP is dense SwiGLU or routed experts (engine.models.moe).

Weights are plain tensors and `Linear`s (no nn.Module tree): q/k/v are fused into one matrix and
gate/up into another at load time, because on CPU fewer, larger matmuls run faster than several
small ones, and every matrix is prepacked for oneDNN once (engine.models.linear).
The forward pass works on a flattened batch (see engine.models.attention) and returns logits
only for the rows the caller asks for, so a long prompt never materializes [T, vocab].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.models.attention import AttentionMetadata, paged_attention
from engine.models.config import ModelConfig
from engine.models.layer_ops import HeadShape, Rotary, TorchLayerOps
from engine.models.linear import Linear
from engine.models.mla import MLAAttention, MLARope
from engine.models.moe import MoEBlock
from engine.models.mrope import MRotary
from engine.models.rope import RotaryTable
from engine.models.weights import CheckpointReader, ShardedReader
from engine.tp.expert_parallel import ExpertParallel
from engine.tp.shard import TPShard

if TYPE_CHECKING:
    from engine.models.vision import Tower
    from engine.tp.dp_attention import DPAttentionComm


@dataclass
class LayerWeights:
    """One decoder layer's weights; biases and q/k norms are None where the architecture has none.

    A GQA layer has qkv/o_proj (and `mla` None); an MLA layer has `mla` (and no qkv/o_proj). A dense
    MLP has gate_up/down (and `moe` None); a routed one has `moe`.
    """

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Linear | None = None  # [q_size + 2 * kv_size, hidden], with the q/k/v biases if any
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    o_proj: Linear | None = None
    gate_up: Linear | None = None  # [2 * intermediate, hidden]
    down: Linear | None = None
    mla: MLAAttention | None = None
    moe: MoEBlock | None = None


class DecoderModel:
    """Embedding, N pre-norm decoder layers (GQA attention + SwiGLU MLP), final norm, LM head.

    Tensor-parallel (engine.tp): loaded with a `TPShard`, the model holds one rank's heads and MLP
    columns, and `all_reduce` (in place) sums the row-parallel o_proj/down outputs across ranks.
    Without one (TP 1) no collective is called.

    Pipeline-parallel (engine.tp.pipeline): loaded with `layers`, the model holds one stage's
    consecutive block of layers; only the first stage has the embedding (`embed`, also the head's
    matrix when tied) and only the last the final norm and LM head (None elsewhere). A stage runs
    `forward_layers`, and the last one `final_logits`; `forward` is both, for the whole model.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 embed: torch.Tensor | None, layers: list[LayerWeights], final_norm: torch.Tensor | None,
                 lm_head: Linear | None, layer_ops: TorchLayerOps | None = None, tp_size: int = 1,
                 all_reduce: Callable[[torch.Tensor], None] | None = None) -> None:
        self.config = config
        self.ops = layer_ops or TorchLayerOps()
        self.heads = HeadShape(config.num_heads // tp_size, config.num_kv_heads // tp_size, config.head_dim)
        self.all_reduce = all_reduce
        self.dp: DPAttentionComm | None = None  # set by engine.tp.load under DP attention
        self.dtype = dtype
        self.device = device
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        # GQA's; an MLA layer has its own (engine.models.rope.mla_softmax_scale)
        self.scale = config.head_dim ** -0.5
        # GQA layers rotate whole heads; MLA layers only their qk_rope_head_dim part, by the table
        # their MLARope holds.
        self.rotary = None if config.mla is not None or config.mrope_section else RotaryTable(
            config.rope, config.head_dim, config.max_position_embeddings, dtype, device)
        # Qwen2-VL: positions are [3, T] (engine.models.mrope), rotated per token; the vision
        # tower (engine.models.vision.load_vision_tower) is attached by the loader; LLaVA has plain
        # RoPE and a tower (engine.models.vision_clip).
        self.mrotary = MRotary(config.rope, config.head_dim, config.mrope_section, dtype, device,
                               config.mrope_interleaved) if config.mrope_section else None
        self.vision: Tower | None = None
        # NEXTN (engine.speculative.nextn) reads every row's final-normed hidden state after a forward
        self.keep_normed_hidden = False
        self.normed_hidden: torch.Tensor | None = None

    @classmethod
    def load(cls, model_dir: str, config: ModelConfig, dtype: torch.dtype,
             device: torch.device, layer_ops: TorchLayerOps | None = None, shard: TPShard | None = None,
             all_reduce: Callable[[torch.Tensor], None] | None = None,
             attn_shard: TPShard | None = None, expert_parallel: ExpertParallel | None = None,
             layers: range | None = None) -> DecoderModel:
        """`shard`: this rank's slice of everything; under DP attention `attn_shard` is its slice of
        the attention weights (its place in its DP group), and `shard` that of the MLPs.
        `expert_parallel`: this rank's place under --ep-size (engine.tp.expert_parallel); its MoE
        layers then hold only their EP rank's experts and exchange tokens with the other owners.
        `layers`: the checkpoint layers to hold (a pipeline stage's block; default all of them)."""
        layers = range(config.num_layers) if layers is None else layers
        first, last = layers.start == 0, layers.stop == config.num_layers
        weights = ShardedReader(CheckpointReader(model_dir), device, dtype, shard)
        attn_weights = ShardedReader(weights.reader, device, dtype, attn_shard) if attn_shard else weights
        get = weights.get
        mla_rope = MLARope(config, dtype, device) if config.mla is not None else None
        fused_moe = layer_ops is not None and layer_ops.fused_moe_experts
        layer_weights = [_load_layer(weights, config, i, mla_rope, fused_moe, expert_parallel, attn_weights)
                         for i in layers]
        vocab = (config.vocab_size, config.hidden_size)
        untied_head = "lm_head.weight" in weights and not config.tie_word_embeddings
        # The last stage reads the embedding table only to use it as its (tied) head.
        table = get("model.embed_tokens.weight", vocab) if first or (last and not untied_head) else None
        embed = table if first else None
        lm_head = final_norm = None
        if last:
            head = get("lm_head.weight", vocab) if untied_head else table
            if head is None:  # read above: the last stage reads the table when its head is tied
                raise ValueError("the last stage has neither lm_head.weight nor a tied embedding table")
            # packing copies: the embedding table itself stays plain
            lm_head = Linear(head)
            final_norm = get("model.norm.weight", (config.hidden_size,))
        weights.reader.close()
        return cls(config, dtype, device, embed, layer_weights, final_norm, lm_head, layer_ops,
                   attn_weights.tp_size, all_reduce)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, max_position: int,
                meta: AttentionMetadata, kv_buffer: torch.Tensor,
                logit_rows: torch.Tensor | None,
                image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
        """Run T flattened tokens, store their K/V, return logits [R, vocab] (fp32) for `logit_rows`
        (None on a DP attention rank other than rank 0: see `final_logits`).

        `logit_rows` None means every row (the pure-decode case, where each row is sampled).
        A VL model takes `positions` [3, T] and `image_embeds` (rows, embeddings): the rows whose
        token embeddings the vision tower's outputs replace.
        """
        hidden = self.forward_layers(input_ids, positions, max_position, meta, kv_buffer, image_embeds)
        if self.keep_normed_hidden and self.final_norm is not None:
            self.normed_hidden = self.ops.rms_norm(hidden, self.final_norm, self.config.rms_norm_eps)
        return self.final_logits(hidden, logit_rows)

    def forward_layers(self, tokens: torch.Tensor, positions: torch.Tensor, max_position: int,
                       meta: AttentionMetadata, kv_buffer: torch.Tensor,
                       image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Run this model's layers over T flattened tokens and store their K/V (layer i of this
        model in layer i of `kv_buffer`); return the residual stream [T, hidden].

        `tokens`: the token ids [T] on the first stage (embedded here), else the residual stream
        [T, hidden] the previous stage returned (updated in place).
        """
        ops, eps = self.ops, self.config.rms_norm_eps
        num_tokens = tokens.shape[0]
        rotary: Rotary | None
        if self.mrotary is not None:
            rotary = ops.rotary_rows(*self.mrotary.cos_sin(positions))
        else:
            rotary = ops.rotary(self.rotary, positions, max_position) if self.rotary is not None else None
        # the residual stream, updated in place
        hidden = F.embedding(tokens, self.embed) if self.embed is not None else tokens
        deepstack = None
        if image_embeds is not None:
            # Qwen3-VL's rows are [embedding, deepstack feature of layer 0, of layer 1, ...]
            rows, values = image_embeds[0], image_embeds[1].to(hidden.dtype)
            width = self.config.hidden_size
            hidden.index_copy_(0, rows, values[:, :width])
            if self.config.deepstack_layers:
                deepstack = values[:, width:].view(rows.shape[0], self.config.deepstack_layers, width)
        x = ops.rms_norm(hidden, self.layers[0].input_norm, eps)
        for index, layer in enumerate(self.layers):
            if layer.mla is not None:
                attn_out = layer.mla(x, positions, max_position, kv_buffer, index, meta, ops.mla_attention)
            elif layer.qkv is None or layer.o_proj is None or rotary is None:
                raise ValueError(f"layer {index} has neither MLA nor GQA weights and a rotary table")
            else:
                q, k, v = ops.qk_norm_rope_store(layer.qkv(x), rotary, layer.q_norm, layer.k_norm, eps,
                                                 self.heads, kv_buffer, index, meta.slots)
                attended = paged_attention(q, k, v, kv_buffer, index, meta, self.scale,
                                           ops.paged_decode_attention, ops.extend_attention)
                attn_out = layer.o_proj(attended.view(num_tokens, self.heads.q_size))
            if self.dp is not None:
                self.dp.attn_all_reduce(attn_out)
            elif self.all_reduce is not None:
                self.all_reduce(attn_out)
            x = ops.add_rms_norm(hidden, attn_out, layer.post_norm, eps)
            mlp = self._mlp(layer, x)
            if deepstack is not None and index < deepstack.shape[1]:
                # as transformers: the layer's output, then its deepstack feature on the image rows
                hidden.add_(mlp)
                hidden.index_add_(0, rows, deepstack[:, index])
                if index + 1 < len(self.layers):
                    x = ops.rms_norm(hidden, self.layers[index + 1].input_norm, eps)
            elif index + 1 < len(self.layers):
                x = ops.add_rms_norm(hidden, mlp, self.layers[index + 1].input_norm, eps)
            else:
                hidden.add_(mlp)
        return hidden

    def final_logits(self, hidden: torch.Tensor, logit_rows: torch.Tensor | None) -> torch.Tensor | None:
        """fp32 logits [R, vocab] of the residual stream's `logit_rows` (None: every row); the last
        stage's (the one holding the final norm and LM head). Under DP attention only rank 0 gets
        them (every group's rows); other ranks get None."""
        if self.final_norm is None:
            raise RuntimeError("final_logits on a pipeline stage without the LM head (not the last stage)")
        if logit_rows is not None:
            hidden = hidden.index_select(0, logit_rows)
        normed = self.ops.rms_norm(hidden, self.final_norm, self.config.rms_norm_eps)
        if self.dp is not None:
            return self._dp_logits(self.dp, normed)
        return self.logits(normed)

    def _mlp(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        """The layer's whole MLP output for the rows `x`: this rank's partial summed over its TP
        group. Under DP attention the MLP runs on every group's rows (engine.tp.dp_attention)."""
        rows = self.dp.gather(x) if self.dp is not None else x
        if layer.moe is not None:
            out = layer.moe(rows)
        elif layer.gate_up is not None and layer.down is not None:
            out = layer.down(self.ops.silu_and_mul(layer.gate_up(rows)))
        else:
            raise ValueError("a layer has neither routed experts nor a dense MLP")
        if self.all_reduce is not None:
            self.all_reduce(out)
        return self.dp.mine(out) if self.dp is not None else out

    def _dp_logits(self, dp: DPAttentionComm, normed: torch.Tensor) -> torch.Tensor | None:
        """DP attention: rank 0 gets every group's rows to sample and returns their logits (rows in
        group order); other ranks return None."""
        rows = dp.gather(normed, dp.shape.sampled)
        return self.logits(rows) if dp.is_driver else None

    def idle_forward(self) -> torch.Tensor | None:
        """DP attention, a step in which this rank's group has no tokens: join every layer's MLP
        for the other groups' rows, and the final gather."""
        if self.dp is None:
            raise RuntimeError("idle_forward runs under DP attention only (engine.tp.dp_attention)")
        empty = self.dp.empty(self.config.hidden_size, self.dtype)
        for layer in self.layers:
            self._mlp(layer, empty)
        return self._dp_logits(self.dp, empty)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 [R, vocab] for final-normed hidden states [R, hidden]."""
        if self.lm_head is None:
            raise RuntimeError("logits on a pipeline stage without the LM head (not the last stage)")
        return self.lm_head(hidden).float()


def _load_layer(weights: ShardedReader, config: ModelConfig, i: int, mla_rope: MLARope | None = None,
                fused_moe: bool = False, expert_parallel: ExpertParallel | None = None,
                attn_weights: ShardedReader | None = None) -> LayerWeights:
    p = f"model.layers.{i}."
    attn_weights = attn_weights or weights
    hidden = config.hidden_size
    layer = LayerWeights(input_norm=weights.get(p + "input_layernorm.weight", (hidden,)),
                         post_norm=weights.get(p + "post_attention_layernorm.weight", (hidden,)))
    if config.mla is not None:
        layer.mla = MLAAttention.load(attn_weights, p + "self_attn.", config, mla_rope)
    else:
        _load_gqa(attn_weights, config, p + "self_attn.", layer)
        if config.qk_norm and (layer.q_norm is None or layer.k_norm is None):
            raise ValueError(f"{config.architecture} checkpoint lacks q_norm/k_norm in layer {i}")
    if config.moe is not None and i in config.moe.sparse_layers:
        layer.moe = MoEBlock.load(weights, p, config, fused=fused_moe, ep=expert_parallel)
    else:
        mlp, width = p + "mlp.", config.intermediate_size
        gate = weights.rows(weights.get(mlp + "gate_proj.weight", (width, hidden)))
        up = weights.rows(weights.get(mlp + "up_proj.weight", (width, hidden)))
        layer.gate_up = Linear(torch.cat([gate, up]),
                               _cat_biases(weights, [mlp + "gate_proj.bias", mlp + "up_proj.bias"]))
        layer.down = Linear(weights.columns(weights.get(mlp + "down_proj.weight", (hidden, width))),
                            weights.row_bias(weights.maybe(mlp + "down_proj.bias")))
    return layer


def _load_gqa(weights: ShardedReader, config: ModelConfig, attn: str, layer: LayerWeights) -> None:
    hidden, head_dim = config.hidden_size, config.head_dim
    rows = {"q": config.num_heads * head_dim, "k": config.num_kv_heads * head_dim,
            "v": config.num_kv_heads * head_dim}
    layer.qkv = Linear(torch.cat([weights.rows(weights.get(attn + f"{x}_proj.weight", (rows[x], hidden)))
                                  for x in "qkv"]),
                       _cat_biases(weights, [attn + f"{x}_proj.bias" for x in "qkv"]))
    if config.qk_norm:
        layer.q_norm = weights.maybe(attn + "q_norm.weight", (head_dim,))
        layer.k_norm = weights.maybe(attn + "k_norm.weight", (head_dim,))
    layer.o_proj = Linear(weights.columns(weights.get(attn + "o_proj.weight", (hidden, rows["q"]))),
                          weights.row_bias(weights.maybe(attn + "o_proj.bias")))


def _cat_biases(weights: ShardedReader, names: list[str]) -> torch.Tensor | None:
    """The column-parallel biases of a fused projection: all or none of `names` must exist."""
    parts = [bias for bias in (weights.maybe(n) for n in names) if bias is not None]
    if not parts:
        return None
    if len(parts) < len(names):
        raise ValueError(f"checkpoint has only some of the biases {names}")
    return torch.cat([weights.rows(p) for p in parts])
