"""A checkpoint whose greedy answers copy their prompts: the workload n-gram speculation is for.

NGRAM drafts what followed an earlier occurrence of a request's last tokens, so it pays where answers
repeat what is already in the context (code edits, quoting, summaries). A random-weight model never
copies, so this writes one that does from a Qwen3 checkpoint, keeping its shape and so its cost:
every layer still runs, but only layer 0's attention adds to the residual stream (every other
`o_proj` and every `down_proj` is zero, as in tools/models/agreeing_draft.py), and that attention is
a positional head that looks exactly `period - 1` tokens back:
- one hidden dimension is the same constant in every token's embedding, and q and k read only it,
  so after Qwen3's q/k norms they are constant vectors and a score depends on the distance alone:
  k holds (1, 0) in each of the fastest rotary pairs, q the same pair turned by `period - 1` times
  its frequency, so the score is the sum of cos(freq * (distance - (period - 1))), largest exactly at
  that distance (`q_norm`'s weight sets how sharp: the margin to every other distance is checked
  below);
- v is the token's embedding projected onto orthonormal directions, and o_proj writes it back
  scaled up, so the residual holds mostly the embedding of the token `period - 1` back;
- the head is the embedding matrix, so the answer's next token is that token: position i predicts
  token i + 1 - period. An answer repeats its prompt's last `period` tokens, over and over.

    python -m tools.models.copying_model --model .cache/models/small --out .cache/models/small-copying
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
FAST_PAIRS = 8  # rotary pairs the head uses: the fastest ones tell neighbouring distances apart
SHARPNESS = 20.0  # q_norm's weight: a score margin of about 16 between the copied position and any other
COPY_GAIN = 8.0  # how much the copied token's embedding outweighs the current token's in the residual


def distance_scores(period: int, head_dim: int, rope_theta: float, max_distance: int) -> torch.Tensor:
    """The attention score (before softmax, after the 1/sqrt(head_dim) scale) at each distance
    0..max_distance, as the q and k written below give it."""
    freqs = rope_theta ** (-torch.arange(FAST_PAIRS, dtype=torch.float64) * 2 / head_dim)
    distance = torch.arange(max_distance + 1, dtype=torch.float64)
    cosines = torch.cos(torch.outer(distance - (period - 1), freqs)).sum(1)
    # q and k each have FAST_PAIRS unit pairs: q_norm/k_norm scale each pair to sqrt(head_dim / FAST_PAIRS).
    return SHARPNESS * (head_dim / FAST_PAIRS) * cosines / math.sqrt(head_dim)


def copying_weights(tensors: dict[str, torch.Tensor], config: dict, period: int,
                    seed: int = 0) -> dict[str, torch.Tensor]:
    """`tensors` (a Qwen3 checkpoint's) rewritten so that position i predicts token i + 1 - period."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    if FAST_PAIRS > head_dim // 2 or kv_heads * head_dim >= hidden:
        raise SystemExit(f"head_dim {head_dim} with {kv_heads} kv heads cannot hold the copying head "
                         f"(need head_dim >= {2 * FAST_PAIRS} and kv_heads * head_dim < hidden_size)")
    out = {}
    for key, tensor in tensors.items():
        silent = key.endswith(("mlp.down_proj.weight", "self_attn.o_proj.weight"))
        out[key] = torch.zeros_like(tensor) if silent else tensor.clone()
    dtype = out["model.embed_tokens.weight"].dtype
    embed = out["model.embed_tokens.weight"].float()
    constant = hidden - 1  # the dimension every token holds alike: q and k read only it
    embed[:, constant] = embed[:, :constant].pow(2).mean().sqrt()
    out["model.embed_tokens.weight"] = embed.to(dtype)
    if "lm_head.weight" in out:
        out["lm_head.weight"] = embed.to(dtype).clone()
    prefix = "model.layers.0.self_attn."
    for key in ("model.norm.weight", "model.layers.0.input_layernorm.weight", f"{prefix}k_norm.weight"):
        out[key] = torch.ones_like(out[key])
    out[f"{prefix}q_norm.weight"] = torch.full_like(out[f"{prefix}q_norm.weight"], SHARPNESS)
    freqs = (config.get("rope_theta", 10000.0)
             ** (-torch.arange(FAST_PAIRS, dtype=torch.float64) * 2 / head_dim))
    q_head, k_head = torch.zeros(head_dim, dtype=torch.float64), torch.zeros(head_dim, dtype=torch.float64)
    half = head_dim // 2
    # Rotary turns pair (x_f, x_{f+half}) by position * freq_f; q turned back by (period - 1) * freq_f
    # meets k exactly at that distance.
    q_head[:FAST_PAIRS] = torch.cos((period - 1) * freqs)
    q_head[half:half + FAST_PAIRS] = -torch.sin((period - 1) * freqs)
    k_head[:FAST_PAIRS] = 1.0
    q_proj = torch.zeros(heads * head_dim, hidden)
    q_proj[:, constant] = q_head.repeat(heads).float()
    k_proj = torch.zeros(kv_heads * head_dim, hidden)
    k_proj[:, constant] = k_head.repeat(kv_heads).float()
    # v: the token's (normed) embedding on kv_heads * head_dim orthonormal directions, none of them the
    # constant one; o_proj: back onto those directions, from the first query head of each kv group.
    generator = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(hidden - 1, kv_heads * head_dim, generator=generator,
                                           dtype=torch.float64))
    directions = torch.zeros(hidden, kv_heads * head_dim, dtype=torch.float64)
    directions[:constant] = basis
    o_proj = torch.zeros(hidden, heads * head_dim)
    group = heads // kv_heads
    for kv in range(kv_heads):
        block = directions[:, kv * head_dim:(kv + 1) * head_dim]
        o_proj[:, kv * group * head_dim:(kv * group + 1) * head_dim] = (COPY_GAIN * block).float()
    for name, weight in (("q_proj", q_proj), ("k_proj", k_proj), ("v_proj", directions.T.float()),
                         ("o_proj", o_proj)):
        out[f"{prefix}{name}.weight"] = weight.to(dtype).contiguous()
    return out


def write(model: Path, out: Path, period: int = 8) -> Path:
    config = json.loads((model / "config.json").read_text())
    if config.get("model_type") != "qwen3":
        raise SystemExit(f"{model}: model_type {config.get('model_type')!r}: only qwen3 (its q/k norms make "
                         "the positional head's scores independent of the token)")
    if period < 2:
        raise SystemExit(f"--period must be >= 2, got {period}")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    scores = distance_scores(period, head_dim, config.get("rope_theta", 10000.0),
                             config.get("max_position_embeddings", 4096))
    others = torch.cat([scores[:period - 1], scores[period:]])
    if scores[period - 1] - others.max() < 8:
        raise SystemExit(f"the positional head would not single out distance {period - 1} "
                         f"(margin {float(scores[period - 1] - others.max()):.1f})")
    weights_files = sorted(model.glob("*.safetensors"))
    if len(weights_files) != 1:
        raise SystemExit(f"{model}: expected one model.safetensors, found {len(weights_files)}")
    tensors = copying_weights(load_file(str(weights_files[0])), config, period)
    out.mkdir(parents=True, exist_ok=True)
    for extra in model.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors":
            shutil.copy(extra, out / extra.name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a Qwen3 HF checkpoint folder")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--period", type=int, default=8,
                        help="answers repeat the prompt's last PERIOD tokens")
    args = parser.parse_args(argv)
    print(f"wrote {write(args.model, args.out, args.period)}: its answers repeat their prompt's last "
          f"{args.period} tokens")


if __name__ == "__main__":
    main()
