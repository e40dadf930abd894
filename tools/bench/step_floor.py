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

A second floor, for the math: a dense model's step multiplies every weight matrix by the batch
(2 FLOPs per weight per row) and attends over the K/V (4 FLOPs per query head, dim and context
token); over the fastest dense matmul torch runs on this machine in the same run (fp32 or bf16,
square 1024 matrices, best of a few, the engine's threads). Where the CPU's bf16 math is slow (no
AMX) the step is bound by that, not by memory: the step cannot beat the larger of the two. Not
given for mixture-of-experts models (a step multiplies only the routed experts' weights).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

_BANDWIDTH_BUFFER_BYTES = 512 << 20


_MATMUL_SIZE = 1024


@dataclass(frozen=True)
class StepFloor:
    weight_bytes: int
    kv_bytes: int
    read_gb_s: float
    flops: int | None = None  # a step's math (dense models only)
    matmul_gflop_s: float | None = None  # the fastest dense matmul measured here
    matmul_dtype: str | None = None

    @property
    def ms(self) -> float:
        """The memory floor: bytes over read bandwidth."""
        return (self.weight_bytes + self.kv_bytes) / (self.read_gb_s * 1e9) * 1e3

    @property
    def compute_ms(self) -> float | None:
        if self.flops is None or not self.matmul_gflop_s:
            return None
        return self.flops / (self.matmul_gflop_s * 1e9) * 1e3

    def to_dict(self) -> dict:
        out = {"weight_bytes": self.weight_bytes, "kv_bytes": self.kv_bytes,
               "read_gb_s": round(self.read_gb_s, 2), "floor_ms": round(self.ms, 3)}
        if self.compute_ms is not None:
            out.update({"flops": self.flops, "matmul_gflop_s": round(self.matmul_gflop_s, 1),
                        "matmul_dtype": self.matmul_dtype, "compute_floor_ms": round(self.compute_ms, 3)})
        return out


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


def linear_weights(model_dir: Path, tied: bool) -> int:
    """Weights that multiply the batch: every matrix but an untied input embedding."""
    total = 0
    for name, shape in _tensor_shapes(model_dir).items():
        if len(shape) != 2 or (name.endswith("embed_tokens.weight") and not tied):
            continue
        total += shape[0] * shape[1]
    return total


def matmul_gflop_s(threads: int, passes: int = 5) -> tuple[float, str]:
    """The best rate of torch's square matmul in fp32 and in bf16, with `threads` threads, and its dtype."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best: tuple[float, str] = (0.0, "float32")
        for dtype in (torch.float32, torch.bfloat16):
            a = torch.randn(_MATMUL_SIZE, _MATMUL_SIZE).to(dtype)
            b = torch.randn(_MATMUL_SIZE, _MATMUL_SIZE).to(dtype)
            torch.mm(a, b)  # oneDNN's first call picks and builds its kernel
            for _ in range(passes):
                began = time.perf_counter()
                torch.mm(a, b)
                rate = 2 * _MATMUL_SIZE**3 / (time.perf_counter() - began) / 1e9
                best = max(best, (rate, str(dtype).removeprefix("torch.")))
        return best
    finally:
        torch.set_num_threads(previous)


# On a GPU: a buffer far past its L2 (50 MB on an H100), and a matmul big enough to fill its SMs.
_GPU_BANDWIDTH_BUFFER_BYTES = 2 << 30
_GPU_MATMUL_SIZE = 8192


def gpu_read_bandwidth_gb_s(device: torch.device, passes: int = 5) -> float:
    """Best of `passes` sums over a 2 GiB buffer in the GPU's memory, timed with CUDA events: the
    rate a decode step streams its weights at, at best."""
    buffer = torch.ones(_GPU_BANDWIDTH_BUFFER_BYTES // 2, dtype=torch.bfloat16, device=device)
    buffer.sum(dtype=torch.float32)  # first launch and allocation out of the timing
    best = float("inf")
    for _ in range(passes):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        buffer.sum(dtype=torch.float32)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return _GPU_BANDWIDTH_BUFFER_BYTES / best / 1e9


def gpu_matmul_gflop_s(device: torch.device, passes: int = 5) -> float:
    """The best rate of a bf16 square matmul on the GPU (its tensor cores)."""
    a = torch.randn(_GPU_MATMUL_SIZE, _GPU_MATMUL_SIZE, device=device, dtype=torch.bfloat16)
    b = torch.randn(_GPU_MATMUL_SIZE, _GPU_MATMUL_SIZE, device=device, dtype=torch.bfloat16)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(passes):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mm(a, b)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * _GPU_MATMUL_SIZE**3 / best / 1e9


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


def step_floor(model_dir: str, dtype: str, batch: int, prompt_len: int, new_tokens: int,
               threads: int, device: str = "cpu") -> StepFloor:
    """The step's floor on `device` (cpu, or cuda[:N]: its memory's and tensor cores' rates)."""
    from engine.models.config import ModelConfig

    gpu = torch.device(device) if device.startswith("cuda") else None

    config = ModelConfig.from_dir(model_dir)
    torch_dtype = getattr(torch, dtype)
    context = prompt_len + new_tokens / 2
    kv_per_token = config.kv_layout(page_size=1, dtype=torch_dtype).token_nbytes
    flops = rate = rate_dtype = None
    if config.moe is None and config.mla is None:
        attention = 4 * config.num_layers * config.num_heads * config.head_dim * context
        flops = int(batch * (2 * linear_weights(Path(model_dir), config.tie_word_embeddings) + attention))
        rate, rate_dtype = (gpu_matmul_gflop_s(gpu), "bfloat16") if gpu else matmul_gflop_s(threads)
    bandwidth = gpu_read_bandwidth_gb_s(gpu) if gpu else read_bandwidth_gb_s(threads)
    return StepFloor(weight_bytes(Path(model_dir), torch_dtype, config.tie_word_embeddings),
                     int(batch * context * kv_per_token), bandwidth, flops, rate, rate_dtype)
