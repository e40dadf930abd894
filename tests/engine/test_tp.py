"""Tensor parallelism in the engine: greedy output at TP 2 (and TP 4) equals TP 1 and HF transformers.

Two checkpoints: the Qwen3 tiny preset (4 heads, 2 KV heads, tied embeddings, q/k norm) and the
tiny-kv4 Llama (8 heads, 4 KV heads, untied), so KV heads split 1, 2 and 4 per rank. Prompts of
1..300 tokens run together with chunks of 64, so steps mix decodes and extends with a prefix.
Every follower rank is a real process joined over gloo. A TP size that would split a head is
refused before any process starts, naming both numbers.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.tp.shard import TPShard, UnshardableModel
from tests.engine.conftest import random_prompts, start_engine
from tests.engine.test_parity import NEW_TOKENS, engine_outputs, hf_reference
from tools.models.tiny_model import write_tiny_model

LENGTHS = [1, 7, 17, 64, 130, 300]
LOGPROB_TOLERANCE = 1e-3  # fp32; TP changes only the order of the o_proj/down sums


@pytest.fixture(scope="module")
def kv4_ckpt(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("ckpt") / "kv4", preset="tiny-kv4", seed=2, arch="llama")


@pytest.fixture(scope="module", params=["qwen3", "kv4"])
def case(request):
    model_dir = request.getfixturevalue(f"{request.param}_ckpt")
    prompts = random_prompts(LENGTHS, seed=5)
    return request.param, model_dir, prompts, hf_reference(model_dir, prompts)


async def run(model_dir, prompts, tp_size: int, on_engine=None, **overrides):
    """Greedy outputs of `prompts` on an engine of `tp_size` (and any other EngineConfig
    `overrides`); `on_engine(engine)` looks at the engine before it shuts down."""
    engine = start_engine(model_dir, chunked_prefill_size=64, tp_size=tp_size, **overrides)
    try:
        got = await engine_outputs(engine, prompts)
        stats = engine.stats()
        if on_engine is not None:
            on_engine(engine)
    finally:
        engine.shutdown()
    assert stats.used_pages == 0
    return got


def check_equal(got, expected, what: str) -> None:
    for length, (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(LENGTHS, got, expected, strict=True):
        assert tokens == ref_tokens, f"{what}: prompt of {length} tokens"
        worst = max(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True))
        assert worst < LOGPROB_TOLERANCE, f"{what}: prompt of {length} tokens: logprob off by {worst}"


async def test_tp_matches_tp1_and_hf(case):
    name, model_dir, prompts, hf = case
    tp1 = await run(model_dir, prompts, 1)
    check_equal(tp1, hf, f"{name} TP 1 vs HF")
    sizes = [2, 4] if name == "kv4" else [2]
    for tp_size in sizes:
        got = await run(model_dir, prompts, tp_size)
        check_equal(got, hf, f"{name} TP {tp_size} vs HF")
        assert [t for t, _ in got] == [t for t, _ in tp1], f"{name}: TP {tp_size} differs from TP 1"
    assert NEW_TOKENS == len(tp1[0][0])


def test_shard_slices_whole_heads():
    weight = torch.arange(8 * 3).view(8, 3)
    assert TPShard(1, 2).rows(weight).tolist() == weight[4:].tolist()
    assert TPShard(0, 4).columns(weight.T).tolist() == weight[:2].T.tolist()
    assert TPShard(1, 2).row_bias(torch.ones(3)) is None  # added once, by rank 0


@pytest.mark.parametrize(("tp_size", "named"), [(3, "2 KV heads"), (4, "2 KV heads")])
def test_unshardable_tp_size_is_refused_before_starting_ranks(qwen3_ckpt, tp_size, named):
    with pytest.raises(UnshardableModel, match=f"tp size {tp_size} does not divide the model's {named}"):
        Engine.load(EngineConfig(model_path=str(qwen3_ckpt), num_pages=16, tp_size=tp_size))
