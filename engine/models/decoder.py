"""The one decoder-only transformer behind Llama, Qwen2 and Qwen3 checkpoints.

Weights are plain tensors (no nn.Module tree): q/k/v are fused into one matrix and gate/up into
another at load time, because on CPU fewer, larger matmuls run faster than several small ones.
The forward pass works on a flattened batch (see engine.models.attention) and returns logits
only for the rows the caller asks for, so a long prompt never materializes [T, vocab].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.models.attention import AttentionMetadata, paged_attention
from engine.models.config import ModelConfig
from engine.models.rope import RotaryTable, apply_rotary
from engine.models.weights import CheckpointReader
from kernels import ops


@dataclass
class LayerWeights:
    """One decoder layer's tensors; biases and q/k norms are None where the architecture has none."""

    input_norm: torch.Tensor
    qkv: torch.Tensor  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


# Decode-sized fp32 products on CPU (measured on the small preset, 2 threads, batch 16, whole-step
# timings interleaved with the alternatives): computing (weight @ x.T).T instead of x @ weight.T
# cut a decode step by about 15%, and splitting the LM head into row blocks another 10%. For
# prefill-sized inputs, and for bf16 (where F.linear reaches oneDNN's bf16 kernels and the
# transposed product does not: 4 ms against 22 ms for 12 gate/up matrices), F.linear is faster.
SMALL_ROWS = 32
LM_HEAD_BLOCK = 2048


def _transposed_product(x: torch.Tensor) -> bool:
    return x.shape[0] <= SMALL_ROWS and x.device.type == "cpu" and x.dtype == torch.float32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] @ weight.T [in, out] (+ bias) -> [T, out], contiguous."""
    if not _transposed_product(x):
        return F.linear(x, weight, bias)
    out = torch.mm(weight, x.t()).t().contiguous()
    return out if bias is None else out + bias


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm: normalize in fp32, cast back, then scale by the weight."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class DecoderModel:
    """Embedding, N pre-norm decoder layers (GQA attention + SwiGLU MLP), final norm, LM head."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 embed: torch.Tensor, layers: list[LayerWeights], final_norm: torch.Tensor,
                 lm_head: torch.Tensor) -> None:
        self.config = config
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
             device: torch.device) -> DecoderModel:
        reader = CheckpointReader(model_dir)

        def get(name: str) -> torch.Tensor:
            return reader.get(name).to(device=device, dtype=dtype)

        def maybe(name: str) -> torch.Tensor | None:
            return get(name) if name in reader else None

        def cat_maybe(names: list[str]) -> torch.Tensor | None:
            parts = [maybe(n) for n in names]
            if all(p is None for p in parts):
                return None
            if any(p is None for p in parts):
                raise ValueError(f"checkpoint has only some of the biases {names}")
            return torch.cat(parts)  # type: ignore[arg-type]

        layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            layers.append(LayerWeights(
                input_norm=get(p + "input_layernorm.weight"),
                qkv=torch.cat([get(attn + f"{x}_proj.weight") for x in "qkv"]),
                qkv_bias=cat_maybe([attn + f"{x}_proj.bias" for x in "qkv"]),
                q_norm=maybe(attn + "q_norm.weight") if config.qk_norm else None,
                k_norm=maybe(attn + "k_norm.weight") if config.qk_norm else None,
                o_proj=get(attn + "o_proj.weight"),
                o_bias=maybe(attn + "o_proj.bias"),
                post_norm=get(p + "post_attention_layernorm.weight"),
                gate_up=torch.cat([get(mlp + "gate_proj.weight"), get(mlp + "up_proj.weight")]),
                gate_up_bias=cat_maybe([mlp + "gate_proj.bias", mlp + "up_proj.bias"]),
                down=get(mlp + "down_proj.weight"),
                down_bias=maybe(mlp + "down_proj.bias"),
            ))
            if config.qk_norm and (layers[-1].q_norm is None or layers[-1].k_norm is None):
                raise ValueError(f"{config.architecture} checkpoint lacks q_norm/k_norm in layer {i}")
        embed = get("model.embed_tokens.weight")
        if "lm_head.weight" in reader and not config.tie_word_embeddings:
            lm_head = get("lm_head.weight")
        else:
            lm_head = embed
        final_norm = get("model.norm.weight")
        reader.close()
        return cls(config, dtype, device, embed, layers, final_norm, lm_head)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, max_position: int,
                meta: AttentionMetadata, kv_buffer: torch.Tensor,
                logit_rows: torch.Tensor | None) -> torch.Tensor:
        """Run T flattened tokens, store their K/V, return logits [R, vocab] (fp32) for `logit_rows`.

        `logit_rows` None means every row (the pure-decode case, where each row is sampled).
        """
        cfg = self.config
        num_tokens = input_ids.shape[0]
        eps = cfg.rms_norm_eps
        cos, sin = self.rotary.lookup(positions, max_position)
        hidden = F.embedding(input_ids, self.embed)
        for index, layer in enumerate(self.layers):
            x = rms_norm(hidden, layer.input_norm, eps)
            qkv = linear(x, layer.qkv, layer.qkv_bias)
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = q.view(num_tokens, cfg.num_heads, cfg.head_dim)
            k = k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            v = v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            if layer.q_norm is not None:
                q = rms_norm(q, layer.q_norm, eps)
                k = rms_norm(k, layer.k_norm, eps)
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
            ops.store_kv(kv_buffer, index, meta.slots, k, v)
            attended = paged_attention(q, k, v, kv_buffer, index, meta, self.scale)
            hidden = hidden + linear(attended.view(num_tokens, cfg.q_size), layer.o_proj, layer.o_bias)
            x = rms_norm(hidden, layer.post_norm, eps)
            gate, up = linear(x, layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)
            hidden = hidden + linear(F.silu(gate) * up, layer.down, layer.down_bias)
        if logit_rows is not None:
            hidden = hidden.index_select(0, logit_rows)
        hidden = rms_norm(hidden, self.final_norm, eps)
        return self.logits(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 [R, vocab] for final-normed hidden states [R, hidden]."""
        if not _transposed_product(hidden):
            return F.linear(hidden, self.lm_head).float()
        vocab = self.lm_head.shape[0]
        out = torch.empty(vocab, hidden.shape[0], dtype=hidden.dtype)
        rows = hidden.t()
        for start in range(0, vocab, LM_HEAD_BLOCK):
            torch.mm(self.lm_head[start:start + LM_HEAD_BLOCK], rows, out=out[start:start + LM_HEAD_BLOCK])
        return out.t().contiguous()
