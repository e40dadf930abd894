"""DeepSeek-V3's multi-token-prediction (MTP) layer: the NEXTN drafter's model.

The checkpoint stores it as decoder layer `num_hidden_layers` (transformers ignores it): `enorm`,
`hnorm`, `eh_proj`, a decoder layer's attention and MLP, and `shared_head.{norm,head}`; the token
embedding is the target's unless the layer stores its own. At position i it reads the target's
final-normed hidden state h_i and the next token t_{i+1}, and predicts t_{i+2}:

    x = eh_proj(concat(enorm(embed(t_{i+1})), hnorm(h_i)))      (SGLang's and DeepSeek's order)
    h' = decoder_layer(x)        (its own K/V: the KV pool's layer num_hidden_layers)
    logits = shared_head.head(shared_head.norm(h'))

Chained drafting feeds shared_head.norm(h') back as the next position's h (the draft's estimate of
the target's hidden state there), as SGLang's NEXTN does.

Under tensor parallelism it is sharded as the target's decoder layers are (engine.tp.shard): its
attention heads and MLP (or experts') columns split over the ranks, their partial outputs summed by
the target's all-reduce; enorm, hnorm, eh_proj and the shared head are replicated, like the target's
norms, embedding and LM head; its MLA latent K/V, the same on every rank, in each rank's pool.

`forward` has DecoderModel's signature, so engine.model_runner.ModelRunner runs it over the KV pool
(metadata, slots, pages) unchanged; the hidden states it reads are set in `hidden_in` before each
call, one row per input token in the runner's flattened order.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from engine.models.attention import AttentionMetadata
from engine.models.config import ModelConfig
from engine.models.decoder import DecoderModel, LayerWeights, _load_layer
from engine.models.linear import Linear
from engine.models.mla import MLARope
from engine.models.weights import CheckpointReader, ShardedReader
from engine.tp.shard import TPShard


class MTPLayer:
    """One MTP layer over the target's embedding; its K/V in layer `kv_layer` of the pool."""

    mrotary = None  # plain positions (ModelRunner asks)

    def __init__(self, target: DecoderModel, layer: LayerWeights, embed: torch.Tensor, enorm: torch.Tensor,
                 hnorm: torch.Tensor, eh_proj: Linear, head_norm: torch.Tensor, head: Linear,
                 kv_layer: int) -> None:
        self.target = target
        self.ops = target.ops
        self.eps = target.config.rms_norm_eps
        self.layer = layer
        self.embed = embed
        self.enorm, self.hnorm, self.eh_proj = enorm, hnorm, eh_proj
        self.head_norm, self.head = head_norm, head
        self.kv_layer = kv_layer
        self.hidden_in: torch.Tensor | None = None  # [T, hidden]: h_i of each input row
        self.last_hidden: torch.Tensor | None = None  # [T, hidden]: shared_head.norm(h') of each row

    @classmethod
    def load(cls, model_dir: str, config: ModelConfig, target: DecoderModel,
             shard: TPShard | None = None) -> MTPLayer:
        """ValueError naming why when the checkpoint has no MTP layer this engine can run. `shard`:
        this tensor-parallel rank's part (the target's, loaded with the same)."""
        index = config.num_layers
        prefix = f"model.layers.{index}."
        if config.num_nextn_predict_layers < 1:
            raise ValueError(f"--speculative-algorithm NEXTN needs a checkpoint with DeepSeek-V3's MTP "
                             f"layer: {config.architecture} config.json has num_nextn_predict_layers "
                             f"{config.num_nextn_predict_layers}")
        if config.mla is None:
            raise ValueError("--speculative-algorithm NEXTN runs DeepSeek-V3's MTP layer, which has latent "
                             "attention (MLA); this checkpoint has none")
        weights = ShardedReader(CheckpointReader(model_dir), target.device, target.dtype, shard)
        try:
            if prefix + "eh_proj.weight" not in weights:
                raise ValueError(f"--speculative-algorithm NEXTN: config.json says num_nextn_predict_layers "
                                 f"{config.num_nextn_predict_layers}, but the checkpoint has no "
                                 f"{prefix}eh_proj.weight (the MTP layer's weights were left out)")
            layer_config = config
            if config.moe is not None and prefix + "mlp.gate.weight" in weights:  # a routed MLP
                layer_config = replace(config, moe=replace(config.moe, sparse_layers=(index,)))
            fused_moe = target.ops.fused_moe_experts
            layer = _load_layer(weights, layer_config, index, MLARope(config, target.dtype, target.device),
                                fused_moe)
            hidden = (config.hidden_size,)
            embed = weights.maybe(prefix + "embed_tokens.weight", (config.vocab_size, config.hidden_size))
            if embed is None:
                if target.embed is None:
                    raise ValueError("NEXTN: the MTP layer shares the embedding, which this rank lacks")
                embed = target.embed
            head = weights.maybe(prefix + "shared_head.head.weight", (config.vocab_size, config.hidden_size))
            if head is None and target.lm_head is None:
                raise ValueError("NEXTN: the MTP layer shares the LM head, which this rank lacks")
            eh_proj = weights.get(prefix + "eh_proj.weight", (config.hidden_size, 2 * config.hidden_size))
            return cls(target, layer, embed, weights.get(prefix + "enorm.weight", hidden),
                       weights.get(prefix + "hnorm.weight", hidden), Linear(eh_proj),
                       weights.get(prefix + "shared_head.norm.weight", hidden),
                       Linear(head) if head is not None else target.lm_head,  # type: ignore[arg-type]
                       kv_layer=index)
        finally:
            weights.reader.close()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, max_position: int,
                meta: AttentionMetadata, kv_buffer: torch.Tensor, logit_rows: torch.Tensor | None,
                image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """fp32 logits [R, vocab] of `logit_rows` (None: every row); stores each row's K/V and keeps
        every row's shared_head.norm(h') in `last_hidden`."""
        if self.hidden_in is None or self.hidden_in.shape[0] != input_ids.shape[0]:
            raise RuntimeError("MTPLayer.forward needs hidden_in: one target hidden state per input token")
        ops, eps, layer = self.ops, self.eps, self.layer
        embedded = ops.rms_norm(F.embedding(input_ids, self.embed), self.enorm, eps)
        hidden = self.eh_proj(torch.cat([embedded, ops.rms_norm(self.hidden_in.to(embedded.dtype), self.hnorm,
                                                                 eps)], dim=-1))
        assert layer.mla is not None
        x = ops.rms_norm(hidden, layer.input_norm, eps)
        attn_out = layer.mla(x, positions, max_position, kv_buffer, self.kv_layer, meta, ops.mla_attention)
        all_reduce = self.target.all_reduce  # None on one rank: nothing to sum
        if all_reduce is not None:
            all_reduce(attn_out)
        x = ops.add_rms_norm(hidden, attn_out, layer.post_norm, eps)
        if layer.moe is not None:
            mlp = layer.moe(x)
        elif layer.gate_up is not None and layer.down is not None:
            mlp = layer.down(ops.silu_and_mul(layer.gate_up(x)))
        else:
            raise ValueError("the MTP layer has neither routed experts nor a dense MLP")
        if all_reduce is not None:
            all_reduce(mlp)
        hidden.add_(mlp)
        normed = ops.rms_norm(hidden, self.head_norm, eps)
        self.last_hidden = normed
        rows = normed if logit_rows is None else normed.index_select(0, logit_rows)
        return self.head(rows).float()
