"""How many KV pages an engine gets (see EngineConfig for the rules)."""

from __future__ import annotations

import psutil
import torch

from engine.config import EngineConfig
from libkv.layout import KVLayout


def kv_pages(config: EngineConfig, layout: KVLayout, device: torch.device) -> int:
    """Number of KV pages for `config`; call after the weights are loaded (they are not free memory)."""
    if config.num_pages is not None:
        return config.num_pages
    if config.max_total_tokens is not None:
        return max(layout.pages_for(config.max_total_tokens), 1)
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        budget = free_bytes * config.mem_fraction_static
    else:
        budget = min(psutil.virtual_memory().available * config.mem_fraction_static,
                     config.cpu_kv_cap_gib * 2**30)
    pages = int(budget // layout.page_nbytes)
    if pages <= 0:
        raise MemoryError(f"no memory left for KV pages ({budget / 2**20:.1f} MiB budget, "
                          f"{layout.page_nbytes} bytes per page)")
    return pages
