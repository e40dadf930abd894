"""The floor under a decode step on a CPU: the bytes one step must read from memory, over the read
bandwidth measured on this machine in the same run.

A decode step is memory-bound at small batches: it streams every weight once (all layers, the
lm_head; the embedding only gathers a row per sequence) and each sequence's K/V. Bytes:
- weights: every tensor of the checkpoint but the input embedding (kept when the lm_head is tied to
  it), counted at the dtype the engine runs in. For a mixture-of-experts model this counts every
  expert, an upper bound that a batch of 16 or more nearly reaches;
- K/V: batch x mean context x the KV pool's bytes per token (every layer, K and V; MLA's one latent
  row), the mean context being the prompt plus half the new tokens.
Read bandwidth: the best of a few passes summing a buffer much larger than the caches, on the
engine's thread count.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

_BANDWIDTH_BUFFER_BYTES = 512 << 20


@dataclass(frozen=True)
class StepFloor:
    weight_bytes: int
    kv_bytes: int
    read_gb_s: float

    @property
    def ms(self) -> float:
        return (self.weight_bytes + self.kv_bytes) / (self.read_gb_s * 1e9) * 1e3

    def to_dict(self) -> dict:
        return {"weight_bytes": self.weight_bytes, "kv_bytes": self.kv_bytes, "read_gb_s": round(self.read_gb_s, 2),
                "floor_ms": round(self.ms, 3)}


def _tensor_shapes(model_dir: Path) -> dict[str, list[int]]:
    """Name -> shape of every tensor in the checkpoint's safetensors files, from their headers only."""
    shapes = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(size))
        shapes.update({name: meta["shape"] for name, meta in header.items() if name != "__metadata__"})
    return shapes


def weight_bytes(model_dir: Path, dtype: torch.dtype, tied: bool) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    total = 0
    for name, shape in _tensor_shapes(model_dir).items():
        if name.endswith("embed_tokens.weight") and not tied:
            continue  # a row per sequence is gathered; the lm_head has its own weight
        numel = 1
        for dim in shape:
            numel *= dim
        total += numel * itemsize
    return total


def read_bandwidth_gb_s(threads: int, passes: int = 5) -> float:
    """Best of `passes` sums over a buffer far larger than the caches, with `threads` threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = torch.ones(_BANDWIDTH_BUFFER_BYTES // 4, dtype=torch.float32)
        buffer.sum()  # fault the pages in
        best = float("inf")
        for _ in range(passes):
            began = time.perf_counter()
            buffer.sum()
            best = min(best, time.perf_counter() - began)
        return _BANDWIDTH_BUFFER_BYTES / best / 1e9
    finally:
        torch.set_num_threads(previous)


def step_floor(model_dir: str, dtype: str, batch: int, prompt_len: int, new_tokens: int, threads: int) -> StepFloor:
    from engine.models.config import ModelConfig

    config = ModelConfig.from_dir(model_dir)
    torch_dtype = getattr(torch, dtype)
    context = prompt_len + new_tokens / 2
    kv_per_token = config.kv_layout(page_size=1, dtype=torch_dtype).token_nbytes
    return StepFloor(weight_bytes(Path(model_dir), torch_dtype, config.tie_word_embeddings),
                     int(batch * context * kv_per_token), read_bandwidth_gb_s(threads))
