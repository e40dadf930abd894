"""The decode step's floor (tools/bench/step_floor.py): the bytes it counts are the checkpoint's tensors
at the run's dtype (the input embedding left out unless the lm_head is tied to it) and the batch's K/V."""

from __future__ import annotations

import io
from contextlib import redirect_stdout

import pytest
import torch
from safetensors.torch import load_file

from engine.models.config import ModelConfig
from tools.bench.engine import print_table
from tools.bench.step_floor import StepFloor, read_bandwidth_gb_s, step_floor, weight_bytes
from tools.models.tiny_model import write_tiny_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("floor") / "qwen3", preset="tiny", seed=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_bytes_count_every_tensor_but_an_untied_embedding(checkpoint, dtype):
    tensors = {}
    for path in checkpoint.glob("*.safetensors"):
        tensors.update(load_file(path))
    itemsize = torch.empty((), dtype=dtype).element_size()
    everything = sum(t.numel() for t in tensors.values()) * itemsize
    embedding = itemsize * next(t.numel() for name, t in tensors.items()
                                if name.endswith("embed_tokens.weight"))
    tied = ModelConfig.from_dir(str(checkpoint)).tie_word_embeddings
    assert weight_bytes(checkpoint, dtype, tied) == (everything if tied else everything - embedding)
    assert weight_bytes(checkpoint, dtype, tied=True) == everything


def test_kv_bytes_are_the_batch_at_its_mean_context(checkpoint):
    config = ModelConfig.from_dir(str(checkpoint))
    floor = step_floor(str(checkpoint), "bfloat16", batch=4, prompt_len=100, new_tokens=20, threads=1)
    per_token = config.num_layers * 2 * config.num_kv_heads * config.head_dim * 2  # K and V, bf16
    assert floor.kv_bytes == 4 * 110 * per_token
    assert floor.read_gb_s > 0 and floor.ms > 0


def test_read_bandwidth_is_measured():
    assert read_bandwidth_gb_s(threads=1, passes=2) > 0


def test_the_table_prints_the_floor_and_the_ratio():
    floor = StepFloor(weight_bytes=200_000_000, kv_bytes=29_000_000, read_gb_s=31.0)
    report = {"batch": 16, "prompt_len": 128, "new_tokens": 64, "threads": 2, "dtype": "bfloat16",
              "device": "cpu",
              "pdserve": {"decode_tokens_per_s": 800.0, "decode_ms_per_step": 20.0, "prefill_s": 0.1,
                          "peak_rss_mib": None},
              "floor": floor.to_dict(), "pdserve_step_over_floor": 20.0 / floor.ms,
              "pdserve_best_step_over_floor": 18.0 / floor.ms}
    out = io.StringIO()
    with redirect_stdout(out):
        print_table(report)
    assert "floor    7.4 ms/step: 200 MB of weights + 29.0 MB of K/V at 31.0 GB/s read" in out.getvalue()
    assert "pdserve step / floor 2.71x (best round 2.44x)" in out.getvalue()


def test_the_compute_floor_counts_every_matrix_times_the_batch_and_the_attention(checkpoint):
    config = ModelConfig.from_dir(str(checkpoint))
    tensors = {}
    for path in checkpoint.glob("*.safetensors"):
        tensors.update(load_file(path))
    matrices = sum(t.numel() for name, t in tensors.items()
                   if t.dim() == 2
                   and (config.tie_word_embeddings or not name.endswith("embed_tokens.weight")))
    floor = step_floor(str(checkpoint), "bfloat16", batch=4, prompt_len=100, new_tokens=20, threads=1)
    attention = 4 * config.num_layers * config.num_heads * config.head_dim * 110
    assert floor.flops == 4 * (2 * matrices + attention)
    assert floor.matmul_gflop_s > 0 and floor.matmul_dtype in ("float32", "bfloat16")
    assert floor.compute_ms == pytest.approx(floor.flops / floor.matmul_gflop_s / 1e6)


def test_no_compute_floor_for_a_mixture_of_experts(tmp_path):
    moe = write_tiny_model(tmp_path / "moe", preset="tiny-moe", seed=0)
    floor = step_floor(str(moe), "bfloat16", batch=4, prompt_len=16, new_tokens=4, threads=1)
    assert floor.flops is None and floor.compute_ms is None and "compute_floor_ms" not in floor.to_dict()


def test_the_table_prints_the_compute_floor_next_to_the_memory_floor():
    floor = StepFloor(weight_bytes=200_000_000, kv_bytes=29_000_000, read_gb_s=31.0, flops=3_200_000_000,
                      matmul_gflop_s=320.0, matmul_dtype="float32")
    report = {"batch": 16, "prompt_len": 128, "new_tokens": 64, "threads": 2, "dtype": "bfloat16",
              "device": "cpu",
              "pdserve": {"decode_tokens_per_s": 800.0, "decode_ms_per_step": 20.0, "prefill_s": 0.1,
                          "peak_rss_mib": None},
              "floor": floor.to_dict(), "pdserve_step_over_floor": 20.0 / floor.ms,
              "pdserve_best_step_over_floor": 18.0 / floor.ms, "pdserve_step_over_compute_floor": 2.0}
    out = io.StringIO()
    with redirect_stdout(out):
        print_table(report)
    assert ("compute  10.0 ms/step: 3.20 GFLOP at 320 GFLOP/s (torch's best square matmul here, float32); "
            "pdserve step / compute floor 2.00x") in out.getvalue()
