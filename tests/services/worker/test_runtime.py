"""What a worker registers as its model's KV layout, whatever its TP size."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.tp.topology import Topology
from libkv.layout import KVLayout
from services.worker.runtime import WorkerRuntime


def runtime_of(rank_layout: KVLayout, tp_size: int) -> WorkerRuntime:
    """A runtime with only what model_layout reads: the engine's (rank 0's) layout and the TP size."""
    config = SimpleNamespace(role="decode", engine=SimpleNamespace(tp_size=tp_size,
                                                                   topology=lambda: Topology(tp_size=tp_size)))
    return WorkerRuntime(config=config, engine=SimpleNamespace(kv_layout=rank_layout),  # type: ignore[arg-type]
                         backend=None, metrics=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_the_registered_layout_is_the_whole_models(tp_size):
    gqa_rank = KVLayout(num_layers=4, num_kv_heads=4 // tp_size, head_dim=64, page_size=16, dtype="bfloat16")
    assert runtime_of(gqa_rank, tp_size).model_layout().num_kv_heads == 4
    # Every rank of an MLA model holds the whole latent: its layout is the model's as it is.
    mla = KVLayout.mla(num_layers=4, kv_lora_rank=512, qk_rope_head_dim=64, page_size=16, dtype="bfloat16")
    assert runtime_of(mla, tp_size).model_layout() == mla
