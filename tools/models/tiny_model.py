"""`pdserve make-tiny-model`: write the built-in random-weight HF checkpoint.

Tests, benchmarks and the default local run need a model without a hub download. This writes a
folder in the same format as a real Qwen3 (or Llama) checkpoint: config.json in the classic layout
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
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tools.models.tokenizer_train import ENDOFTEXT, IM_END, special_token_ids, write_tokenizer

ARCHITECTURES = {"qwen3": ("Qwen3ForCausalLM", "qwen3"), "llama": ("LlamaForCausalLM", "llama")}


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
}


def model_config(preset: TinyPreset, arch: str = "qwen3", **overrides: Any) -> dict[str, Any]:
    """config.json contents for `preset`, with any config field replaced by `overrides`."""
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
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": preset.vocab_size,
    }
    if arch == "qwen3":
        config.update(max_window_layers=preset.num_hidden_layers, sliding_window=None, use_sliding_window=False)
    else:
        config.update(mlp_bias=False, pretraining_tp=1)
    config.update(overrides)
    return config


def _parameter_shapes(config_dir: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Names and shapes of every tensor the HF model class expects, from a model built on `meta`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    shapes = {name: (tuple(p.shape), p.dtype) for name, p in model.named_parameters(remove_duplicate=True)}
    if hf_config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def random_weights(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], std: float,
                   seed: int) -> dict[str, torch.Tensor]:
    """Uniform(-a, a) weights with standard deviation `std`; norms ones, biases zeros.

    Tensors are drawn in sorted-name order from one generator, so the bytes depend only on the
    names, shapes, std and seed.
    """
    generator = torch.Generator().manual_seed(seed)
    half_width = std * math.sqrt(3.0)
    weights = {}
    for name in sorted(shapes):
        shape, dtype = shapes[name]
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=dtype)
        elif name.endswith(".bias"):
            weights[name] = torch.zeros(shape, dtype=dtype)
        else:
            uniform = torch.rand(shape, generator=generator, dtype=torch.float32)
            weights[name] = ((uniform * 2.0 - 1.0) * half_width).to(dtype).contiguous()
    return weights


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_tiny_model(out_dir: str | Path, preset: str = "tiny", seed: int = 0, arch: str = "qwen3",
                     tokenizer_vocab_size: int | None = None, **overrides: Any) -> Path:
    """Write a random-weight HF checkpoint folder and return its path.

    `overrides` replace config.json fields (e.g. head_dim=32, num_key_value_heads=1,
    tie_word_embeddings=False, initializer_range=0.1). The tokenizer is trained to the config's
    vocab_size unless `tokenizer_vocab_size` asks for fewer tokens (a padded embedding matrix, as
    real checkpoints have).
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    spec = PRESETS[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = model_config(spec, arch, **overrides)
    vocab = tokenizer_vocab_size or config["vocab_size"]
    if vocab > config["vocab_size"]:
        raise ValueError(f"tokenizer_vocab_size {vocab} exceeds the model's vocab_size {config['vocab_size']}")

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
    weights = random_weights(_parameter_shapes(out), std=config["initializer_range"], seed=seed)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # safetensors creates it owner-only; match the other files
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=Path, help="checkpoint folder to write")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                        help="tiny: about 4M parameters (tests); tiny-kv4: tiny with 8/4 heads, untied "
                        "(tensor-parallel tests); small: about 125M (benchmarks)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the tokenizer corpus and the weights")
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="qwen3")


def main(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    out = write_tiny_model(args.out, preset=args.preset, seed=args.seed, arch=args.arch)
    preset = asdict(PRESETS[args.preset])
    print(f"wrote {args.arch} {args.preset} checkpoint to {out} in {time.perf_counter() - started:.1f}s "
          f"(hidden {preset['hidden_size']}, {preset['num_hidden_layers']} layers, vocab {preset['vocab_size']})")
    return 0
