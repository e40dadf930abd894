"""The one decoder-only transformer behind Llama, Qwen2 and Qwen3 checkpoints.

Weights are plain tensors and `Linear`s (no nn.Module tree): q/k/v are fused into one matrix and
gate/up into another at load time, because on CPU fewer, larger matmuls run faster than several
small ones, and every matrix is prepacked for oneDNN once (engine.models.linear).
The forward pass works on a flattened batch (see engine.models.attention) and returns logits
only for the rows the caller asks for, so a long prompt never materializes [T, vocab].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.models.attention import AttentionMetadata, paged_attention
from engine.models.config import ModelConfig
from engine.models.layer_ops import HeadShape, TorchLayerOps
from engine.models.linear import Linear
from engine.models.rope import RotaryTable
from engine.models.weights import CheckpointReader
from engine.tp.shard import TPShard


@dataclass
class LayerWeights:
    """One decoder layer's weights; biases and q/k norms are None where the architecture has none."""

    input_norm: torch.Tensor
    qkv: Linear  # [q_size + 2 * kv_size, hidden], with the q/k/v biases if any
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # [2 * intermediate, hidden]
    down: Linear


class DecoderModel:
    """Embedding, N pre-norm decoder layers (GQA attention + SwiGLU MLP), final norm, LM head.

    Tensor-parallel (engine.tp): loaded with a `TPShard`, the model holds one rank's heads and MLP
    columns, and `all_reduce` (in place) sums the row-parallel o_proj/down outputs across ranks.
    Without one (TP 1) no collective is called.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 embed: torch.Tensor, layers: list[LayerWeights], final_norm: torch.Tensor,
                 lm_head: Linear, layer_ops: TorchLayerOps | None = None, tp_size: int = 1,
                 all_reduce: Callable[[torch.Tensor], None] | None = None) -> None:
        self.config = config
        self.ops = layer_ops or TorchLayerOps()
        self.heads = HeadShape(config.num_heads // tp_size, config.num_kv_heads // tp_size, config.head_dim)
        self.all_reduce = all_reduce
        self.dtype = dtype
        self.device = device
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.scale = config.head_dim ** -0.5
        self.rotary = RotaryTable(config.rope, config.head_dim, config.max_position_embeddings,
                                  dtype, device)

    @classmethod
    def load(cls, model_dir: str, config: ModelConfig, dtype: torch.dtype,
             device: torch.device, layer_ops: TorchLayerOps | None = None, shard: TPShard | None = None,
             all_reduce: Callable[[torch.Tensor], None] | None = None) -> DecoderModel:
        reader = CheckpointReader(model_dir)
        column_parallel = shard.rows if shard else (lambda tensor: tensor)
        row_parallel = shard.columns if shard else (lambda tensor: tensor)

        def get(name: str) -> torch.Tensor:
            return reader.get(name).to(device=device, dtype=dtype)

        def maybe(name: str) -> torch.Tensor | None:
            return get(name) if name in reader else None

        def row_bias(name: str) -> torch.Tensor | None:
            return shard.row_bias(maybe(name)) if shard else maybe(name)

        def cat_maybe(names: list[str]) -> torch.Tensor | None:
            parts = [maybe(n) for n in names]
            if all(p is None for p in parts):
                return None
            if any(p is None for p in parts):
                raise ValueError(f"checkpoint has only some of the biases {names}")
            return torch.cat([column_parallel(p) for p in parts])  # type: ignore[arg-type]

        layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            layers.append(LayerWeights(
                input_norm=get(p + "input_layernorm.weight"),
                qkv=Linear(torch.cat([column_parallel(get(attn + f"{x}_proj.weight")) for x in "qkv"]),
                           cat_maybe([attn + f"{x}_proj.bias" for x in "qkv"])),
                q_norm=maybe(attn + "q_norm.weight") if config.qk_norm else None,
                k_norm=maybe(attn + "k_norm.weight") if config.qk_norm else None,
                o_proj=Linear(row_parallel(get(attn + "o_proj.weight")), row_bias(attn + "o_proj.bias")),
                post_norm=get(p + "post_attention_layernorm.weight"),
                gate_up=Linear(torch.cat([column_parallel(get(mlp + "gate_proj.weight")),
                                          column_parallel(get(mlp + "up_proj.weight"))]),
                               cat_maybe([mlp + "gate_proj.bias", mlp + "up_proj.bias"])),
                down=Linear(row_parallel(get(mlp + "down_proj.weight")), row_bias(mlp + "down_proj.bias")),
            ))
            if config.qk_norm and (layers[-1].q_norm is None or layers[-1].k_norm is None):
                raise ValueError(f"{config.architecture} checkpoint lacks q_norm/k_norm in layer {i}")
        embed = get("model.embed_tokens.weight")
        if "lm_head.weight" in reader and not config.tie_word_embeddings:
            lm_head = Linear(get("lm_head.weight"))
        else:
            lm_head = Linear(embed)  # packing copies: the embedding table itself stays plain
        final_norm = get("model.norm.weight")
        reader.close()
        return cls(config, dtype, device, embed, layers, final_norm, lm_head, layer_ops,
                   shard.size if shard else 1, all_reduce)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, max_position: int,
                meta: AttentionMetadata, kv_buffer: torch.Tensor,
                logit_rows: torch.Tensor | None) -> torch.Tensor:
        """Run T flattened tokens, store their K/V, return logits [R, vocab] (fp32) for `logit_rows`.

        `logit_rows` None means every row (the pure-decode case, where each row is sampled).
        """
        ops, eps = self.ops, self.config.rms_norm_eps
        num_tokens = input_ids.shape[0]
        rotary = ops.rotary(self.rotary, positions, max_position)
        hidden = F.embedding(input_ids, self.embed)  # the residual stream, updated in place
        x = ops.rms_norm(hidden, self.layers[0].input_norm, eps)
        for index, layer in enumerate(self.layers):
            q, k, v = ops.qk_norm_rope_store(layer.qkv(x), rotary, layer.q_norm, layer.k_norm, eps, self.heads,
                                             kv_buffer, index, meta.slots)
            attended = paged_attention(q, k, v, kv_buffer, index, meta, self.scale, ops.paged_decode_attention,
                                       ops.extend_attention)
            attn_out = layer.o_proj(attended.view(num_tokens, self.heads.q_size))
            if self.all_reduce is not None:
                self.all_reduce(attn_out)
            x = ops.add_rms_norm(hidden, attn_out, layer.post_norm, eps)
            mlp = layer.down(ops.silu_and_mul(layer.gate_up(x)))
            if self.all_reduce is not None:
                self.all_reduce(mlp)
            if index + 1 < len(self.layers):
                x = ops.add_rms_norm(hidden, mlp, self.layers[index + 1].input_norm, eps)
            else:
                hidden.add_(mlp)
        if logit_rows is not None:
            hidden = hidden.index_select(0, logit_rows)
        return self.logits(ops.rms_norm(hidden, self.final_norm, eps))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 [R, vocab] for final-normed hidden states [R, hidden]."""
        return self.lm_head(hidden).float()
