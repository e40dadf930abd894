"""Part "tp": tensor parallelism over 2 GPUs with NCCL (engine/tp picks NCCL for CUDA ranks; rank r
runs on cuda:r), fp32 greedy output equal to HF transformers on CUDA, as tests/engine/test_tp.py
checks with gloo on CPU. The follower must hold memory on GPU 1 (the driver's count: it is another
process)."""

from __future__ import annotations

import pytest

from tests.gpu.hardware import require

require("tp", gpus=2)

from tests.engine.conftest import random_prompts, start_engine  # noqa: E402
from tests.engine.test_parity import LENGTHS, check_equal, engine_outputs, hf_reference  # noqa: E402
from tests.gpu.hardware import used_bytes  # noqa: E402
from tools.models.tiny_model import write_tiny_model  # noqa: E402

pytestmark = pytest.mark.gpu


async def test_tp2_over_nccl_equals_hf(tmp_path):
    model_dir = write_tiny_model(tmp_path / "tiny", preset="tiny", seed=0)  # 2 KV heads: one per rank
    prompts = random_prompts(LENGTHS, seed=7)
    expected = hf_reference(model_dir, prompts, device="cuda:0")
    before = used_bytes(1)
    engine = start_engine(model_dir, device="cuda:0", tp_size=2, chunked_prefill_size=64, num_pages=512)
    try:
        got = await engine_outputs(engine, prompts)
        follower = used_bytes(1) - before
    finally:
        engine.shutdown()
    check_equal(got, expected)
    # A CUDA context alone is a few hundred MiB; nothing of rank 1 on GPU 1 would leave about 0.
    assert follower > 64 << 20, f"GPU 1 gained {follower >> 20} MiB while TP 2 ran: rank 1 is not there"
