"""Part "tp": tensor parallelism over 2 GPUs with NCCL (engine/tp picks NCCL for CUDA ranks; rank r
runs on cuda:r), fp32 greedy output equal to HF transformers on CUDA, as tests/engine/test_tp.py
checks with gloo on CPU. Both GPUs must hold memory of this process or its TP follower."""

from __future__ import annotations

import os

import pytest

from tests.gpu.hardware import require

require("tp", gpus=2)

import psutil  # noqa: E402

from tests.engine.conftest import random_prompts, start_engine  # noqa: E402
from tests.engine.test_parity import LENGTHS, check_equal, engine_outputs, hf_reference  # noqa: E402
from tests.gpu.hardware import gpus_of_pids  # noqa: E402
from tools.models.tiny_model import write_tiny_model  # noqa: E402

pytestmark = pytest.mark.gpu


async def test_tp2_over_nccl_equals_hf(tmp_path):
    model_dir = write_tiny_model(tmp_path / "tiny", preset="tiny", seed=0)  # 2 KV heads: one per rank
    prompts = random_prompts(LENGTHS, seed=7)
    expected = hf_reference(model_dir, prompts, device="cuda:0")
    engine = start_engine(model_dir, device="cuda:0", tp_size=2, chunked_prefill_size=64, num_pages=512)
    try:
        got = await engine_outputs(engine, prompts)
        ours = {os.getpid(), *(child.pid for child in psutil.Process().children(recursive=True))}
        used = set().union(*(gpus for pid, gpus in gpus_of_pids().items() if pid in ours))
    finally:
        engine.shutdown()
    check_equal(got, expected)
    assert used == {0, 1}, f"the TP ranks hold GPUs {sorted(used)}, expected 0 and 1"
