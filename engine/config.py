"""EngineConfig: every setting of one in-process engine, in one frozen dataclass.

Each setting, its default and its help text are written here once. Commands turn the fields into
flags with pdserve.config_flags (`pdserve generate` takes them all; a worker nests this config in
its own, so `pdserve launch-server` takes them with the same spelling and defaults).
"""

from __future__ import annotations

from dataclasses import dataclass, field


def _help(text: str) -> dict:
    return {"help": text}


@dataclass(frozen=True)
class EngineConfig:
    """How to load and run a model. Services compose this into their own configs.

    KV memory: `num_pages` if given; else `max_total_tokens` tokens if given; else
    `mem_fraction_static` of the memory free after loading the weights (on CPU: psutil's
    available memory, capped at `cpu_kv_cap_gib` because the host is shared with everything else;
    on CUDA: torch.cuda.mem_get_info).
    """

    model_path: str = field(metadata=_help("HF checkpoint folder (config.json, *.safetensors, tokenizer)"))
    dtype: str = field(default="auto", metadata=_help(
        "auto | float32 | bfloat16 | float16 (auto: the checkpoint's dtype)"))
    device: str = field(default="cpu", metadata=_help(
        "cpu, cuda or cuda:N; a worker also takes auto (its default): cuda:<--base-gpu-id> when CUDA is "
        "available, else cpu"))
    page_size: int = field(default=16, metadata=_help("tokens per KV page"))
    num_pages: int | None = field(default=None, metadata=_help(
        "KV pages; unset = sized from free memory (--mem-fraction-static)"))
    max_total_tokens: int | None = field(default=None, metadata=_help("KV capacity in tokens (instead of --num-pages)"))
    mem_fraction_static: float = field(default=0.8, metadata=_help(
        "fraction of the memory free after loading the weights given to the KV pool when --num-pages is unset"))
    cpu_kv_cap_gib: float = field(default=2.0, metadata=_help(
        "upper bound of the CPU KV pool when sized from free memory"))
    max_running_requests: int = field(default=64, metadata=_help("most requests in the running (decode) batch"))
    chunked_prefill_size: int = field(default=512, metadata=_help(
        "prompt tokens per forward pass (a longer prompt spans several steps)"))
    num_threads: int | None = field(default=None, metadata=_help("torch CPU threads; unset = torch's default"))
    cpu_kernels: str = field(default="auto", metadata=_help(
        "fused C++ CPU kernels (engine.models.layer_ops) built by `make setup`: auto (if built), on (required) "
        "or off"))
    tp_size: int = field(default=1, metadata=_help(
        "tensor-parallel ranks, one process each: rank 0 (this process: scheduler, and a worker's gRPC) starts "
        "tp_size - 1 more, each holding 1/tp_size of the attention heads, KV heads and MLP columns (must divide "
        "them); 1 = no collectives at all"))
    trust_remote_code: bool = field(default=False, metadata=_help(
        "accepted so that SGLang command lines run unchanged, and ignored: pdserve never executes code from a "
        "checkpoint folder (it reads config.json, *.safetensors and the tokenizer files as data, and refuses "
        "an architecture it does not implement, naming the supported ones)"))
    disable_radix_cache: bool = field(default=False, metadata=_help(
        "turn the prefix cache off (SGLang's flag name): every prompt is computed in full, a decode worker "
        "reuses none of its cached pages, and no KV events are published"))

    def __post_init__(self) -> None:
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError(f"--mem-fraction-static must be in (0, 1], got {self.mem_fraction_static}")
        if self.page_size <= 0:
            raise ValueError(f"--page-size must be positive, got {self.page_size}")
        if self.num_pages is not None and self.num_pages <= 0:
            raise ValueError(f"--num-pages must be positive, got {self.num_pages}")
        if self.tp_size < 1:
            raise ValueError(f"--tp-size must be at least 1, got {self.tp_size}")
        if self.cpu_kernels not in ("auto", "on", "off"):
            raise ValueError(f"--cpu-kernels must be auto, on or off, got {self.cpu_kernels!r}")
