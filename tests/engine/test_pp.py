"""Pipeline parallelism in the engine: greedy output at --pp-size 2 (and 2 stages of TP 2) equals
TP 1 and HF transformers, for the tiny dense preset, tiny-moe and tiny-deepseek (MLA), fp32.

Every stage is a real process joined over gloo; the residual stream moves stage to stage with
send/recv. Prompts of 1..300 tokens run together with chunks of 64 (steps mix decodes and chunked
extends with a prefix), then again one after another so later requests hit the prefix cache.
Also: the bytes rank 0 sends on are one residual stream per token run, and a model with fewer
layers than stages is refused before any rank starts, naming both numbers.
"""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.tp.topology import TopologyError
from tests.engine.conftest import random_prompts, run_in_turn, start_engine
from tests.engine.test_parity import NEW_TOKENS, hf_reference
from tests.engine.test_tp import LENGTHS, check_equal, run
from tools.models.tiny_model import write_tiny_model

# 4 layers each: 2 per stage. The dense preset's PP is also served end to end against PP 1 in
# tests/e2e/test_pp.py, so here it runs in `make test-all` only.
PRESETS = [pytest.param("tiny", marks=pytest.mark.long), "tiny-moe", "tiny-deepseek"]
HIDDEN = 256  # every preset's hidden size
FP32 = 4


@pytest.fixture(scope="module", params=PRESETS)
def case(request, tmp_path_factory):
    model_dir = write_tiny_model(tmp_path_factory.mktemp("ckpt") / request.param,
                                 preset=request.param, seed=0)
    prompts = random_prompts(LENGTHS, seed=5)
    return request.param, model_dir, prompts, hf_reference(model_dir, prompts)


async def test_pp_matches_tp1_and_hf(case):
    name, model_dir, prompts, hf = case
    tp1 = await run(model_dir, prompts, 1, num_threads=1)
    check_equal(tp1, hf, f"{name} TP 1 vs HF")
    sent: list[int] = []
    pp2 = await run(model_dir, prompts, 1, pp_size=2, num_threads=1,
                    on_engine=lambda engine: sent.append(engine.runner.runner.stage.bytes_sent))
    check_equal(pp2, hf, f"{name} PP 2 vs HF")
    assert [t for t, _ in pp2] == [t for t, _ in tp1], f"{name}: PP 2 differs from TP 1"
    # Stage 0 sends each token it runs on once, as a fp32 row of the residual stream: every
    # prompt token, then every output token but the last.
    tokens_run = sum(LENGTHS) + len(LENGTHS) * (NEW_TOKENS - 1)
    assert sent == [tokens_run * HIDDEN * FP32]
    both = await run(model_dir, prompts, 2, pp_size=2, num_threads=1)
    check_equal(both, hf, f"{name} PP 2 x TP 2 vs HF")
    assert [t for t, _ in both] == [t for t, _ in tp1], f"{name}: PP 2 x TP 2 differs from TP 1"


async def test_prefix_cache_hits_under_pp(case):
    name, model_dir, _, _ = case
    base = random_prompts([150], seed=3)[0]
    prompts = [base, base[:70] + random_prompts([9], seed=4)[0], base]
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)
    engine = start_engine(model_dir, chunked_prefill_size=64, page_size=16, pp_size=2, num_threads=1)
    try:
        got = await run_in_turn(engine, prompts, params)  # one after another, so the later ones hit
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert stats.prefix_hit_tokens >= 64 + 144, name  # 4 pages of the second prompt, 9 of the third
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, hf_reference(model_dir, prompts),
                                                              strict=True):
        assert tokens == ref_tokens, name
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True)) < 1e-3, name


def test_more_stages_than_layers_is_refused(qwen3_ckpt):
    with pytest.raises(TopologyError, match="--pp-size 5 is more than the model's 4 layers"):
        Engine.load(EngineConfig(model_path=str(qwen3_ckpt), num_pages=16, pp_size=5, num_threads=1))
