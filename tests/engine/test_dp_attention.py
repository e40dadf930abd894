"""DP attention (`--enable-dp-attention --dp-size D`): D groups, each with its own requests, batch,
KV pool and prefix cache, attention over their own tokens and the MLP over every group's rows.

Greedy tokens equal HF transformers' (and logprobs agree) for a dense model and for DeepSeek (MLA +
routed experts, with and without expert parallelism) with TP 2 split into 2 groups of one rank, and
for a model with 4 KV heads as TP 4 in 2 groups of 2 ranks (attention TP inside each group);
requests are spread over the groups, a repeated prompt lands on the group that caches it, and every
page is free afterwards.
"""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.dp_engine import DPEngine, load_engine
from tests.engine.conftest import random_prompts
from tests.engine.test_parity import engine_outputs, hf_reference
from tests.engine.test_tp import LENGTHS, check_equal
from tools.models.tiny_model import write_tiny_model


@pytest.fixture(scope="module")
def deepseek_ckpt(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("ckpt") / "deepseek", preset="tiny-deepseek", seed=3)


@pytest.fixture(scope="module")
def kv4_ckpt(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("ckpt") / "kv4", preset="tiny-kv4", seed=2, arch="llama")


def start(model_dir, tp_size: int, dp_size: int, ep_size: int = 1) -> DPEngine:
    engine = load_engine(EngineConfig(model_path=str(model_dir), num_pages=128, chunked_prefill_size=64,
                                      tp_size=tp_size, dp_size=dp_size, enable_dp_attention=True,
                                      ep_size=ep_size,
                                      num_threads=1))
    assert isinstance(engine, DPEngine) and len(engine.members) == dp_size
    engine.start()
    return engine


@pytest.mark.parametrize(("model", "tp_size", "ep_size"), [
    ("qwen3_ckpt", 2, 1), ("deepseek_ckpt", 2, 1), ("deepseek_ckpt", 2, 2), ("kv4_ckpt", 4, 1)])
async def test_dp_attention_matches_hf(model, tp_size, ep_size, request):
    model_dir = request.getfixturevalue(model)
    prompts = random_prompts(LENGTHS, seed=7)
    expected = hf_reference(model_dir, prompts)
    engine = start(model_dir, tp_size, 2, ep_size)
    try:
        got = await engine_outputs(engine, prompts)
        steps = [member.stats().steps for member in engine.members]
        # the same prompts again: each lands on the group that caches its pages, and still matches
        hits_before = engine.stats().prefix_hit_tokens
        again = await engine_outputs(engine, prompts[3:])
        stats = engine.stats()
    finally:
        engine.shutdown()
    check_equal(got, expected, f"{model} TP {tp_size} (EP {ep_size}) as 2 DP attention groups vs HF")
    assert [t for t, _ in again] == [t for t, _ in got[3:]]
    assert all(steps), f"every group ran requests: steps per group {steps}"
    assert stats.prefix_hit_tokens - hits_before >= sum((n // 16) * 16 for n in LENGTHS[3:]) - 16 * 3
    assert stats.used_pages == 0


async def test_reservations_are_placed_on_groups_and_released_there(qwen3_ckpt):
    """The PD side of a DP engine (the decode's reservation, the prefill's held pages): a room's
    pages are reserved on one group, stay there until released, and free that group's pages."""
    engine = start(qwen3_ckpt, 2, 2)
    try:
        prompts = random_prompts([40, 40, 40], seed=9)
        first = engine.reserve_prompt("r0", prompts[0])
        second = engine.reserve_prompt("r1", prompts[1])
        assert first is not None and second is not None
        assert {engine.group_of("r0"), engine.group_of("r1")} == {0, 1}  # the least loaded each time
        with pytest.raises(ValueError, match="already has reserved or held pages"):
            engine.reserve_prompt("r0", prompts[2])  # a room holds one reservation, as on one engine
        used = [member.pages.used_pages for member in engine.members]
        assert used == [3, 3], used
        assert engine.release("r0") and engine.group_of("r0") is None
        assert not engine.release("r0")
        assert engine.release("r1")
        assert engine.stats().used_pages == 0
        # One at a time, each released before the next: the groups still take turns.
        turns = []
        for i, prompt in enumerate(random_prompts([40] * 4, seed=10)):
            assert engine.reserve_prompt(f"s{i}", prompt) is not None
            turns.append(engine.group_of(f"s{i}"))
            assert engine.release(f"s{i}")
        assert turns == [0, 1, 0, 1], turns
        assert engine.placed == [3, 3]
    finally:
        engine.shutdown()
