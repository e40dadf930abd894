"""EngineConfig: every setting of one in-process engine, in one frozen dataclass."""

from __future__ import annotations

from dataclasses import dataclass


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

    def __post_init__(self) -> None:
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}")
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if self.num_pages is not None and self.num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {self.num_pages}")
