"""`pdserve make-tiny-model`: write the built-in random-weight HF checkpoint.

Tests, benchmarks and the default local run need a model without a hub download. This writes a
folder in the same format as a real Qwen3 (or Llama, Qwen3-MoE, Mixtral, DeepSeek V2/V3) checkpoint,
experts one tensor per expert as published checkpoints ship them: config.json in the classic layout
(`rope_theta`, `torch_dtype` at top level, as Qwen3-4B and Llama-3.1-8B ship it), model.safetensors,
a byte-level BPE tokenizer trained here (tools.models.tokenizer_train), the ChatML chat template and
generation_config.json. Same arguments, same bytes: the tokenizer corpus comes from the seed and
the weights from a seeded torch.Generator, independent of transformers' own init code.

Init scale: every matrix is drawn uniform with standard deviation `initializer_range` (0.3 here,
not HF's 0.02: with 0.02 greedy decoding of a random model repeats one token; with 0.3 greedy output
varies and the median top-1/top-2 logit gap is about 1 (tiny) to 1.6 (small), so an engine's greedy
tokens can be compared exactly with HF's without rounding flipping argmaxes; 0.1 gave 0.3-0.5).
Norm weights are ones. Uniform rather than normal because uniform sampling from integers is the
same on every CPU, while vectorized Box-Muller code paths may differ in the last bit.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tools.models.tokenizer_train import ENDOFTEXT, IM_END, special_token_ids, write_tokenizer

ARCHITECTURES = {"qwen3": ("Qwen3ForCausalLM", "qwen3"), "llama": ("LlamaForCausalLM", "llama"),
                 "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
                 "mixtral": ("MixtralForCausalLM", "mixtral"),
                 "deepseek_v2": ("DeepseekV2ForCausalLM", "deepseek_v2"),
                 "deepseek_v3": ("DeepseekV3ForCausalLM", "deepseek_v3"),
                 "qwen2_vl": ("Qwen2VLForConditionalGeneration", "qwen2_vl"),
                 "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl"),
                 "qwen3_vl": ("Qwen3VLForConditionalGeneration", "qwen3_vl"),
                 "llava": ("LlavaForConditionalGeneration", "llava")}


@dataclass(frozen=True)
class TinyPreset:
    """Shape of one built-in checkpoint; `corpus_bytes` sizes the tokenizer's training text."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    # tiny ties lm_head to the embeddings (as Qwen3-0.6B/4B do; a quarter of its parameters would
    # otherwise be a second 4096x256 matrix); small does not (as Llama-3.1-8B, Qwen3-8B), so the
    # two presets exercise both lm_head paths of the engine's weight loader.
    tie_word_embeddings: bool
    corpus_bytes: int
    initializer_range: float = 0.3
    max_position_embeddings: int = 4096
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    arch: str = "qwen3"  # a key of ARCHITECTURES; write_tiny_model's `arch` may name another
    # Architecture-specific config.json fields (experts, latent attention), written when the
    # checkpoint's arch is of the preset's family (deepseek_v2 and _v3 are one family).
    extra: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"  # of the saved tensors and config.json's torch_dtype
    # A vocabulary far beyond what the corpus can teach a BPE tokenizer trains for minutes: the
    # tokenizer then gets this many tokens and the embedding matrix is padded, as real ones are.
    tokenizer_vocab_size: int | None = None
    # Write model-NNNNN-of-NNNNN.safetensors shards of about this many bytes plus an index, drawing
    # each shard's tensors only when it is written, so host memory holds one shard, not the model.
    shard_bytes: int | None = None


PRESETS: dict[str, TinyPreset] = {
    "tiny": TinyPreset(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, intermediate_size=768, vocab_size=4096, tie_word_embeddings=True,
                       corpus_bytes=1_000_000),
    "small": TinyPreset(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                        head_dim=64, intermediate_size=2048, vocab_size=32000, tie_word_embeddings=False,
                        corpus_bytes=4_000_000),
    # Four KV heads (eight query heads of 32) so tensor parallelism splits KV heads 2 and 4 ways;
    # written as a Llama (`--arch llama`) by the TP tests. Untied, like small.
    "tiny-kv4": TinyPreset(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                           head_dim=32, intermediate_size=768, vocab_size=4096, tie_word_embeddings=False,
                           corpus_bytes=1_000_000),
    # Qwen3-MoE: 8 experts of width 256, 2 per token, renormalised (as Qwen3-30B-A3B); layer 1 dense.
    "tiny-moe": TinyPreset(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=64, intermediate_size=768, vocab_size=4096, tie_word_embeddings=True,
                           corpus_bytes=1_000_000, arch="qwen3_moe",
                           extra=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])),
    # small's attention and vocabulary with 16 experts of width 192 (4 per token) in every layer:
    # about 153M parameters (612 MB in fp32), a quarter of them active per token.
    "small-moe": TinyPreset(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                            num_key_value_heads=4, head_dim=64, intermediate_size=2048, vocab_size=32000,
                            tie_word_embeddings=False,
                            corpus_bytes=4_000_000, arch="qwen3_moe",
                            extra=dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=192,
                                       norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])),
    # DeepSeek-V3 in miniature: multi-head latent attention, layer 0 dense, then 8 routed experts in
    # 4 groups (a token picks 2 experts from its 2 best groups, sigmoid scores with a correction
    # bias) plus one shared expert. No head_dim or GQA: MLA's dims are the q/kv ranks below.
    "tiny-deepseek": TinyPreset(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                num_key_value_heads=4, head_dim=64, intermediate_size=512, vocab_size=4096,
                                tie_word_embeddings=False, corpus_bytes=1_000_000, arch="deepseek_v3",
                                extra=dict(first_k_dense_replace=1, n_routed_experts=8, n_group=4,
                                           topk_group=2, num_experts_per_tok=2, n_shared_experts=1,
                                           moe_intermediate_size=256, moe_layer_freq=1, q_lora_rank=128,
                                           kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64,
                                           v_head_dim=64, rope_interleave=True, norm_topk_prob=True,
                                           routed_scaling_factor=2.5, scoring_func="sigmoid",
                                           topk_method="noaux_tc", num_nextn_predict_layers=1)),
    # tiny-deepseek at small's width, depth and vocabulary (benchmarks): 16 routed experts of width
    # 192 in 4 groups, 4 per token from the 2 best groups, one shared expert, and DeepSeek-V3's own
    # latent (kv_lora_rank 512 + rope 64, the one shape vLLM's CPU MLA kernel is built for, so the two
    # engines can be compared); about 170M parameters.
    "small-deepseek": TinyPreset(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                 num_key_value_heads=12, head_dim=64, intermediate_size=2048,
                                 vocab_size=32000, tie_word_embeddings=False, corpus_bytes=4_000_000,
                                 arch="deepseek_v3",
                                 extra=dict(first_k_dense_replace=1, n_routed_experts=16, n_group=4,
                                            topk_group=2, num_experts_per_tok=4, n_shared_experts=1,
                                            moe_intermediate_size=192, moe_layer_freq=1, q_lora_rank=384,
                                            kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64,
                                            v_head_dim=64, rope_interleave=True, norm_topk_prob=True,
                                            routed_scaling_factor=2.5, scoring_func="sigmoid",
                                            topk_method="noaux_tc", num_nextn_predict_layers=1)),
    # Qwen3-4B's dimensions (its published config.json), random bf16 weights: 4.0B parameters, 8 GB,
    # for decode throughput on a GPU beside the seeds' Qwen3-4B figures (scripts/test_gpu.sh writes it
    # there; it is never committed or downloaded). HF's init range, since nothing compares its tokens.
    "qwen3-4b-shape": TinyPreset(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                                 num_key_value_heads=8, head_dim=128, intermediate_size=9728,
                                 vocab_size=151936, tie_word_embeddings=True, corpus_bytes=4_000_000,
                                 initializer_range=0.02, max_position_embeddings=40960, dtype="bfloat16",
                                 tokenizer_vocab_size=32000, shard_bytes=2 << 30),
    # Qwen2-VL in miniature (tools.models.tiny_vl writes it; the fields here are its decoder's).
    "tiny-vl": TinyPreset(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=32, intermediate_size=256, vocab_size=4096, tie_word_embeddings=True,
                          corpus_bytes=1_000_000, arch="qwen2_vl"),
    # Qwen2.5-VL in miniature: tiny-vl's decoder, a tower with window attention (tools.models.tiny_vl).
    "tiny-qwen25-vl": TinyPreset(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=32, intermediate_size=256, vocab_size=4096,
                                 tie_word_embeddings=True, corpus_bytes=1_000_000, arch="qwen2_5_vl"),
    # Qwen3-VL in miniature: a Qwen3 decoder with interleaved M-RoPE, deepstack (tools.models.tiny_vl).
    "tiny-qwen3-vl": TinyPreset(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=32, intermediate_size=256, vocab_size=4096,
                                tie_word_embeddings=True, corpus_bytes=1_000_000, arch="qwen3_vl"),
    # LLaVA in miniature: CLIP tower, projector, Llama decoder (tools.models.tiny_llava).
    "tiny-llava": TinyPreset(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=32, intermediate_size=256, vocab_size=4096,
                             tie_word_embeddings=True, corpus_bytes=1_000_000, rope_theta=10000.0,
                             arch="llava"),
}
# Vision-language presets (each written by its own module) and their architectures.
VL_PRESETS = {"tiny-vl": "qwen2_vl", "tiny-qwen25-vl": "qwen2_5_vl", "tiny-qwen3-vl": "qwen3_vl",
              "tiny-llava": "llava"}
VL_PRESET_OF = {arch: preset for preset, arch in VL_PRESETS.items()}


def model_config(preset: TinyPreset, arch: str | None = None, **overrides: Any) -> dict[str, Any]:
    """config.json contents for `preset` as `arch` (default: the preset's own), with any config field
    replaced by `overrides`."""
    arch = arch or preset.arch
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(ARCHITECTURES)}")
    architecture, model_type = ARCHITECTURES[arch]
    ids = special_token_ids()
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids[ENDOFTEXT],
        "eos_token_id": ids[IM_END],
        "head_dim": preset.head_dim,
        "hidden_act": "silu",
        "hidden_size": preset.hidden_size,
        "initializer_range": preset.initializer_range,
        "intermediate_size": preset.intermediate_size,
        "max_position_embeddings": preset.max_position_embeddings,
        "num_attention_heads": preset.num_attention_heads,
        "num_hidden_layers": preset.num_hidden_layers,
        "num_key_value_heads": preset.num_key_value_heads,
        "rms_norm_eps": preset.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": preset.rope_theta,
        "tie_word_embeddings": preset.tie_word_embeddings,
        "torch_dtype": preset.dtype,
        "use_cache": True,
        "vocab_size": preset.vocab_size,
    }
    if arch in ("qwen3", "qwen3_moe"):
        config.update(max_window_layers=preset.num_hidden_layers, sliding_window=None,
                      use_sliding_window=False)
    elif arch == "llama":
        config.update(mlp_bias=False, pretraining_tp=1)
    elif arch == "mixtral":
        config.update(sliding_window=None)
    else:  # DeepSeek: MLA has no head_dim of its own (transformers derives one from the rope dim)
        del config["head_dim"]
    if _family(arch) == _family(preset.arch):
        config.update(preset.extra)
    config.update(overrides)
    return config


def _family(arch: str) -> str:
    return arch.split("_")[0]  # qwen3 and qwen3_moe; deepseek_v2 and deepseek_v3


def _parameter_shapes(config_dir: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Names and shapes of every tensor the HF model class expects, from a model built on `meta`:
    its parameters and its saved buffers (DeepSeek V3's e_score_correction_bias), in transformers'
    in-memory layout (experts fused, see `published_layout`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    shapes = {name: (tuple(p.shape), p.dtype) for name, p in model.named_parameters(remove_duplicate=True)}
    saved = set(model.state_dict())
    shapes.update({name: (tuple(b.shape), b.dtype) for name, b in model.named_buffers() if name in saved})
    if hf_config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    if hf_config.model_type == "deepseek_v3":
        shapes.update(_mtp_shapes(shapes, hf_config.num_hidden_layers,
                                  getattr(hf_config, "num_nextn_predict_layers", 0) or 0))
    return shapes


def _mtp_shapes(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], num_layers: int,
                num_mtp: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """DeepSeek-V3's multi-token-prediction layers, which transformers does not build: each stored as
    layer num_layers + i, a decoder layer shaped like the last one plus enorm, hnorm, eh_proj and
    shared_head.{norm,head} (the embedding is the target's, not stored again)."""
    last = f"model.layers.{num_layers - 1}."
    hidden_shape, dtype = shapes["model.norm.weight"]
    (hidden,) = hidden_shape
    head_shape = shapes["lm_head.weight"][0] if "lm_head.weight" in shapes else shapes[
        "model.embed_tokens.weight"][0]
    out = {}
    for i in range(num_mtp):
        prefix = f"model.layers.{num_layers + i}."
        out.update({prefix + name[len(last):]: shape for name, shape in shapes.items()
                    if name.startswith(last)})
        out.update({prefix + "enorm.weight": ((hidden,), dtype), prefix + "hnorm.weight": ((hidden,), dtype),
                    prefix + "eh_proj.weight": ((hidden, 2 * hidden), dtype),
                    prefix + "shared_head.norm.weight": ((hidden,), dtype),
                    prefix + "shared_head.head.weight": (head_shape, dtype)})
    return out


def random_weights(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], std: float,
                   seed: int) -> dict[str, torch.Tensor]:
    """Uniform(-a, a) weights with standard deviation `std`; norms ones, biases zeros.

    Tensors are drawn in sorted-name order from one generator, so the bytes depend only on the
    names, shapes, std and seed.
    """
    return dict(iter_random_weights(shapes, std, seed))


def iter_random_weights(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], std: float, seed: int,
                        dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """`random_weights` one (name, tensor) at a time, floating ones cast to `dtype` if given."""
    generator = torch.Generator().manual_seed(seed)
    half_width = std * math.sqrt(3.0)
    for name in sorted(shapes):
        shape, own = shapes[name]
        out = dtype if dtype is not None and own.is_floating_point else own
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, dtype=out)
        elif name.endswith(".bias"):
            yield name, torch.zeros(shape, dtype=out)
        else:
            uniform = torch.rand(shape, generator=generator, dtype=torch.float32)
            yield name, ((uniform * 2.0 - 1.0) * half_width).to(out).contiguous()


def _shards(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], element_bytes: int,
            shard_bytes: int) -> list[list[str]]:
    """Names in sorted order cut into runs of at most `shard_bytes` (a bigger tensor gets its own)."""
    runs: list[list[str]] = [[]]
    size = 0
    for name in sorted(shapes):
        nbytes = math.prod(shapes[name][0]) * element_bytes
        if runs[-1] and size + nbytes > shard_bytes:
            runs.append([])
            size = 0
        runs[-1].append(name)
        size += nbytes
    return runs


def _save_weights(out: Path, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], std: float, seed: int,
                  dtype: torch.dtype, shard_bytes: int | None, arch: str, fused_experts: bool) -> None:
    """model.safetensors, or shards and model.safetensors.index.json when `shard_bytes` is set.
    The weights are the same either way: one generator draws every tensor in sorted-name order."""
    runs = [sorted(shapes)] if shard_bytes is None else _shards(shapes, dtype.itemsize, shard_bytes)
    drawn = iter_random_weights(shapes, std, seed, dtype)
    weight_map: dict[str, str] = {}
    for index, names in enumerate(runs):
        weights = dict(next(drawn) for _ in names)
        if not fused_experts:
            weights = published_layout(weights, arch)
        file = ("model.safetensors" if shard_bytes is None
                else f"model-{index + 1:05d}-of-{len(runs):05d}.safetensors")
        save_file(weights, str(out / file), metadata={"format": "pt"})
        (out / file).chmod(0o644)  # safetensors creates it owner-only; match the other files
        weight_map.update(dict.fromkeys(weights, file))
    if shard_bytes is not None:
        total = sum(math.prod(shape) for shape, _ in shapes.values()) * dtype.itemsize
        _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total},
                                                            "weight_map": weight_map})


_FUSED_EXPERTS = re.compile(r"(model\.layers\.\d+\.)mlp\.experts\.(gate_up_proj|down_proj)")
_MIXTRAL_GATE = re.compile(r"(model\.layers\.\d+\.)mlp\.gate\.weight")


def published_layout(weights: dict[str, torch.Tensor], arch: str) -> dict[str, torch.Tensor]:
    """`weights` with transformers' fused expert tensors (`mlp.experts.gate_up_proj` [E, 2I, H],
    `mlp.experts.down_proj` [E, H, I]) split into one tensor per expert, named as published
    checkpoints (and transformers' save_pretrained) name them: `mlp.experts.E.{gate,up,down}_proj.weight`,
    for Mixtral `block_sparse_moe.experts.E.{w1,w3,w2}.weight` and `block_sparse_moe.gate.weight`."""
    mixtral = arch == "mixtral"
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    out = {}
    for name, tensor in weights.items():
        fused = _FUSED_EXPERTS.fullmatch(name)
        gate = _MIXTRAL_GATE.fullmatch(name) if mixtral else None
        if gate:
            out[gate[1] + "block_sparse_moe.gate.weight"] = tensor
        elif not fused:
            out[name] = tensor
        else:
            prefix = fused[1] + ("block_sparse_moe.experts." if mixtral else "mlp.experts.")
            for expert, matrix in enumerate(tensor):
                if fused[2] == "down_proj":
                    out[f"{prefix}{expert}.{names[2]}.weight"] = matrix.clone()
                else:
                    gate_rows, up_rows = matrix.chunk(2)
                    out[f"{prefix}{expert}.{names[0]}.weight"] = gate_rows.clone()
                    out[f"{prefix}{expert}.{names[1]}.weight"] = up_rows.clone()
    return out


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_tiny_model(out_dir: str | Path, preset: str = "tiny", seed: int = 0, arch: str | None = None,
                     tokenizer_vocab_size: int | None = None, fused_experts: bool = False,
                     **overrides: Any) -> Path:
    """Write a random-weight HF checkpoint folder and return its path.

    `arch` defaults to the preset's. Expert weights are written one tensor per expert, as published
    checkpoints ship them, or with `fused_experts` in transformers' fused in-memory layout (both
    load in transformers and in the engine). The expert router's correction bias (DeepSeek V3) is
    drawn like a weight, uniform with std `initializer_range`: about the spread of the sigmoid
    scores it is added to, so it and the group limit change which experts a token gets.
    `overrides` replace config.json fields (e.g. head_dim=32, num_key_value_heads=1,
    tie_word_embeddings=False, initializer_range=0.1). The tokenizer is trained to the config's
    vocab_size unless `tokenizer_vocab_size` asks for fewer tokens (a padded embedding matrix, as
    real checkpoints have).
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    spec = PRESETS[preset]
    out = Path(out_dir)
    if spec.arch in VL_PRESETS.values() or arch in VL_PRESETS.values():
        if VL_PRESETS.get(preset) != (arch or spec.arch) or overrides:
            raise ValueError(f"{arch or spec.arch} is written by the "
                             f"{VL_PRESET_OF.get(arch or spec.arch, '?')} preset only, without overrides")
        if spec.arch == "llava":
            from tools.models.tiny_llava import write_tiny_llava

            return write_tiny_llava(out, seed, spec.corpus_bytes)
        from tools.models.tiny_vl import write_tiny_vl

        return write_tiny_vl(out, seed, spec.corpus_bytes, family=spec.arch)
    out.mkdir(parents=True, exist_ok=True)
    config = model_config(spec, arch, **overrides)
    vocab = tokenizer_vocab_size or spec.tokenizer_vocab_size or config["vocab_size"]
    if vocab > config["vocab_size"]:
        raise ValueError(f"tokenizer_vocab_size {vocab} exceeds the model's vocab_size "
                         f"{config['vocab_size']}")

    write_tokenizer(out, vocab_size=vocab, corpus_bytes=spec.corpus_bytes, seed=seed,
                    model_max_length=config["max_position_embeddings"])
    _write_json(out / "config.json", config)
    ids = special_token_ids()
    _write_json(out / "generation_config.json", {
        "bos_token_id": ids[ENDOFTEXT],
        "do_sample": False,
        "eos_token_id": [ids[IM_END], ids[ENDOFTEXT]],
        "pad_token_id": ids[ENDOFTEXT],
    })
    _save_weights(out, _parameter_shapes(out), config["initializer_range"], seed, getattr(torch, spec.dtype),
                  spec.shard_bytes, arch or spec.arch, fused_experts)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=Path, help="checkpoint folder to write")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                        help="tiny: about 4M parameters (tests); tiny-kv4: tiny with 8/4 heads, untied "
                        "(tensor-parallel tests); small: about 125M (benchmarks); tiny-moe: Qwen3-MoE, 8 "
                        "experts, 2 per token (tests); small-moe: Qwen3-MoE, about 153M, 16 experts, 4 per "
                        "token (benchmarks); tiny-deepseek: DeepSeek-V3, latent attention, grouped experts "
                        "and a shared one (tests); small-deepseek: tiny-deepseek at small's size with "
                        "V3's latent (512 + 64), about 170M, 16 experts, 4 per token (benchmarks); "
                        "qwen3-4b-shape: Qwen3-4B's dimensions, random bf16 weights in 2 GB shards, 8 GB "
                        "(GPU benchmarks); tiny-vl: Qwen2-VL (vision tower, M-RoPE decoder); tiny-qwen25-vl: "
                        "Qwen2.5-VL (window-attention tower); tiny-qwen3-vl: Qwen3-VL (interleaved M-RoPE, "
                        "deepstack); tiny-llava: LLaVA (CLIP tower, projector, Llama decoder); each VL "
                        "preset with its processor config and a chat template rendering image parts (tests)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the tokenizer corpus and the weights")
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default=None,
                        help="write the preset as this architecture (default: the preset's own)")


def main(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    out = write_tiny_model(args.out, preset=args.preset, seed=args.seed, arch=args.arch)
    preset = asdict(PRESETS[args.preset])
    print(f"wrote {args.arch or preset['arch']} {args.preset} checkpoint to {out} in "
          f"{time.perf_counter() - started:.1f}s (hidden {preset['hidden_size']}, "
          f"{preset['num_hidden_layers']} layers, vocab {preset['vocab_size']})")
    return 0
