"""EngineConfig: every setting of one in-process engine, in one frozen dataclass."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, fields


@dataclass(frozen=True)
class EngineConfig:
    """How to load and run a model. Services compose this into their own configs.

    KV memory: `num_pages` if given; else `max_total_tokens` tokens if given; else
    `mem_fraction_static` of the memory free after loading the weights (on CPU: psutil's
    available memory, capped at `cpu_kv_cap_gib` because the host is shared with everything else;
    on CUDA: torch.cuda.mem_get_info).
    """

    model_path: str
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16; auto = the checkpoint's dtype
    device: str = "cpu"
    page_size: int = 16
    num_pages: int | None = None
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.8
    cpu_kv_cap_gib: float = 2.0
    max_running_requests: int = 64
    chunked_prefill_size: int = 512
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    cpu_kernels: str = "auto"  # auto | on | off: the fused C++ CPU kernels (engine.models.layer_ops)
    tp_size: int = 1  # tensor-parallel ranks, one process each (engine.tp); 1 = no collectives at all
    disable_radix_cache: bool = False  # SGLang's name: turns the prefix cache off (engine.prefix_cache)

    def __post_init__(self) -> None:
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}")
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if self.num_pages is not None and self.num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {self.num_pages}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be at least 1, got {self.tp_size}")
        if self.cpu_kernels not in ("auto", "on", "off"):
            raise ValueError(f"cpu_kernels must be auto, on or off, got {self.cpu_kernels!r}")


_HELP = {
    "model_path": "HF checkpoint folder (config.json, *.safetensors, tokenizer)",
    "dtype": "auto | float32 | bfloat16 | float16 (auto: the checkpoint's dtype)",
    "device": "cpu, cuda or cuda:N",
    "page_size": "tokens per KV page",
    "num_pages": "KV pages (default: sized from free memory)",
    "max_total_tokens": "KV capacity in tokens (instead of num_pages)",
    "mem_fraction_static": "fraction of free memory for KV pages when no size is given",
    "cpu_kv_cap_gib": "upper bound of the CPU KV pool when sized from free memory",
    "max_running_requests": "most requests in the running batch",
    "chunked_prefill_size": "prompt tokens per step (a longer prompt spans several steps)",
    "num_threads": "torch intra-op threads",
    "cpu_kernels": "fused C++ CPU kernels built by `make setup`: auto (if built), on (required) or off",
    "tp_size": "tensor-parallel ranks (processes) sharing the model's heads and MLP columns",
    "disable_radix_cache": "turn the prefix cache off: every prompt is computed in full",
}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One --flag per EngineConfig field, defaults taken from the dataclass (one source of truth)."""
    for f in fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.default is MISSING:
            parser.add_argument(flag, required=True, help=_HELP[f.name])
            continue
        if isinstance(f.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                help=f"{_HELP[f.name]} (default: {f.default})")
            continue
        kind = int if f.default is None else type(f.default)  # every optional field is a count
        parser.add_argument(flag, type=kind, default=f.default, help=f"{_HELP[f.name]} (default: {f.default})")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})
