"""Speculative decoding on a tensor-parallel engine (every follower rank a real process over gloo):
greedy output at TP 2 identical to TP 2 without drafts for NGRAM, STANDALONE (the draft model whole
on rank 0) and NEXTN (the MTP layer sharded like a decoder layer), drafts both accepted and
rejected, every page back."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.sampling import SamplingParams
from engine.speculative.config import SpeculativeConfig
from engine.speculative.nextn_ranks import check_nextn_topology
from tests.engine.conftest import random_prompts, start_engine
from tests.engine.test_speculative import _outputs
from tools.models.agreeing_mtp import make_mtp_agree
from tools.models.tiny_model import write_tiny_model

GREEDY = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=7, max_new_tokens=24, ignore_eos=True)
NEXTN = SpeculativeConfig(speculative_algorithm="NEXTN", speculative_num_draft_tokens=4)


def _prompts() -> list[list[int]]:
    """Random prompts (drafts mostly rejected) and prompts repeating a short run (the tiny model's
    answers repeat too, so n-gram drafts are accepted)."""
    runs = random_prompts([3, 6], seed=8)
    return random_prompts([9, 70], seed=5) + [(run * 30)[:n] for run, n in zip(runs, [40, 33], strict=True)]


async def _run(ckpt, prompts, spec: SpeculativeConfig | None, **overrides):
    params_list = [GREEDY, SEEDED] + [GREEDY] * (len(prompts) - 2)  # a seeded row decodes beside verifies
    engine = start_engine(ckpt, chunked_prefill_size=32, tp_size=2,
                          **overrides, **({"speculative": spec} if spec else {}))
    try:
        got = await _outputs(engine, prompts, params_list)
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert stats.used_pages == 0  # no draft's page leaked
    return got, stats


async def _check_against_spec_off(ckpt, prompts, spec: SpeculativeConfig):
    """The engine's stats with `spec`, after checking its greedy rows' output equals spec off's."""
    expected, _ = await _run(ckpt, prompts, None)
    got, stats = await _run(ckpt, prompts, spec)
    greedy = [i for i in range(len(prompts)) if i != 1]
    assert [got[i] for i in greedy] == [expected[i] for i in greedy]
    return stats


async def test_standalone_keeps_greedy_output_at_tp2(qwen3_ckpt) -> None:
    """The draft model runs whole on rank 0; it is the target itself, so every greedy draft is
    accepted (NGRAM's test below has rejected ones: the verify path is the same)."""
    stats = await _check_against_spec_off(qwen3_ckpt, _prompts(), SpeculativeConfig(
        speculative_algorithm="STANDALONE", speculative_num_draft_tokens=4,
        speculative_draft_model_path=str(qwen3_ckpt)))
    assert stats.spec_accepted_tokens > 0.8 * stats.spec_drafted_tokens > 0


# tests/e2e/test_speculative.py's PD TP 1 -> 2 test decodes with NGRAM at TP 2 in `make test`
@pytest.mark.long
async def test_ngram_keeps_greedy_output_at_tp2(qwen3_ckpt) -> None:
    stats = await _check_against_spec_off(qwen3_ckpt, _prompts(), SpeculativeConfig(
        speculative_algorithm="NGRAM", speculative_num_draft_tokens=4))
    assert 0 < stats.spec_accepted_tokens < stats.spec_drafted_tokens


def test_nextn_with_pipeline_stages_is_refused_naming_why() -> None:
    config = EngineConfig(model_path="m", pp_size=2, speculative=NEXTN)
    with pytest.raises(ValueError, match="--pp-size > 1 is not supported: the MTP layer reads the last"):
        check_nextn_topology(config)
    check_nextn_topology(EngineConfig(model_path="m", tp_size=2, speculative=NEXTN))


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    """tiny-deepseek with its MTP layer made to nearly agree with the target (drafts mostly accepted)."""
    return make_mtp_agree(write_tiny_model(tmp_path_factory.mktemp("ckpt") / "deepseek-mtp",
                                           preset="tiny-deepseek", seed=0))


# tests/e2e/test_speculative.py's PD TP 1 -> 2 test decodes with NEXTN at TP 2 in `make test`
@pytest.mark.long
@pytest.mark.parametrize("layout", ["plain", "retraction"])
async def test_nextn_keeps_greedy_output_at_tp2(mtp_ckpt, layout) -> None:
    """The MTP layer sharded as a decoder layer, its K/V in each rank's extra pool layer, rank 0 deciding
    every draft length: output identical to TP 2 without drafts, its drafts mostly accepted (the
    checkpoint's MTP layer nearly agrees with its target) but not all."""
    prompts = random_prompts([21, 40, 9, 33], seed=5)
    # retraction: 4-token pages, fewer than the four requests need at once
    overrides = dict(page_size=4, num_pages=40) if layout == "retraction" else {}
    expected, _ = await _run(mtp_ckpt, prompts, None, **overrides)
    got, stats = await _run(mtp_ckpt, prompts, NEXTN, **overrides)
    greedy = [i for i in range(len(prompts)) if i != 1]
    assert [got[i] for i in greedy] == [expected[i] for i in greedy]
    assert 0.5 * stats.spec_drafted_tokens < stats.spec_accepted_tokens < stats.spec_drafted_tokens
    if layout == "retraction":
        assert stats.total_retractions > 0
