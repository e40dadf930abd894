"""What a worker registers as its model's KV layout, whatever its TP and PP sizes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.tp.topology import Topology
from libkv.layout import KVLayout
from services.worker.runtime import WorkerRuntime


def runtime_of(rank_layout: KVLayout, tp_size: int, pp_size: int = 1, num_layers: int = 4) -> WorkerRuntime:
    """A runtime with only what model_layout reads: the engine's (rank 0's) layout, the model's
    layer count and the TP and PP sizes."""
    config = SimpleNamespace(role="decode", engine=SimpleNamespace(
        tp_size=tp_size, pp_size=pp_size, topology=lambda: Topology(tp_size=tp_size, pp_size=pp_size)))
    engine = SimpleNamespace(kv_layout=rank_layout, model_config=SimpleNamespace(num_layers=num_layers))
    return WorkerRuntime(config=config, engine=engine,  # type: ignore[arg-type]
                         backend=None, metrics=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_the_registered_layout_is_the_whole_models(tp_size):
    gqa_rank = KVLayout(num_layers=4, num_kv_heads=4 // tp_size, head_dim=64, page_size=16, dtype="bfloat16")
    assert runtime_of(gqa_rank, tp_size).model_layout().num_kv_heads == 4
    # Every rank of an MLA model holds the whole latent: its layout is the model's as it is.
    mla = KVLayout.mla(num_layers=4, kv_lora_rank=512, qk_rope_head_dim=64, page_size=16, dtype="bfloat16")
    assert runtime_of(mla, tp_size).model_layout() == mla


def test_a_staged_worker_registers_every_layer():
    # Rank 0 of 2 stages of TP 2 holds 2 of the 3 layers (the first stage is one longer) and 2 KV heads.
    stage0 = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, page_size=16, dtype="bfloat16")
    whole = runtime_of(stage0, tp_size=2, pp_size=2, num_layers=3).model_layout()
    assert (whole.num_layers, whole.num_kv_heads) == (3, 4)
