"""NEXTN (DeepSeek-V3's MTP layer as the drafter): greedy output identical to decoding without drafts in
mixed batches, with retraction and with prefix-cache hits, every page back; a checkpoint without the
layer refused naming why. The checkpoint's MTP layer is made to nearly agree with its target
(tools.models.agreeing_mtp) so that verifies both accept and reject drafts."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
from safetensors import safe_open

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.speculative.config import SpeculativeConfig
from pdserve.config_flags import add_config_arguments, config_from_args
from tests.engine.conftest import random_prompts, start_engine
from tests.engine.test_pd_hooks import colocated, disaggregated
from tests.engine.test_speculative import _outputs
from tools.models.tiny_model import write_tiny_model

GREEDY = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=7, max_new_tokens=30, ignore_eos=True)
NEXTN = SpeculativeConfig(speculative_algorithm="NEXTN", speculative_num_draft_tokens=4)


async def _run(ckpt: Path, prompts, params_list, spec: bool, **overrides):
    engine = start_engine(ckpt, **overrides, **({"speculative": NEXTN} if spec else {}))
    try:
        got = await _outputs(engine, prompts, params_list)
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert stats.used_pages == 0  # no draft's page leaked
    return got, stats


def test_the_deepseek_preset_stores_the_mtp_layer_after_the_last(deepseek_ckpt) -> None:
    config = json.loads((deepseek_ckpt / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    layer = f"model.layers.{config['num_hidden_layers']}."
    with safe_open(str(deepseek_ckpt / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
    for part in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head",
                 "self_attn.kv_a_proj_with_mqa", "mlp.gate"):
        assert f"{layer}{part}.weight" in names


@pytest.mark.parametrize("layout", ["plain", "retraction"])
async def test_nextn_keeps_greedy_output_in_mixed_batches(agreeing_ckpt, layout) -> None:
    prompts = random_prompts([21, 40, 9, 33], seed=5)
    params_list = [GREEDY, SEEDED, GREEDY, GREEDY]  # the seeded one samples its drafts beside greedy verifies
    # retraction: 4-token pages, fewer than the four requests need at once
    overrides = dict(page_size=4, num_pages=40, chunked_prefill_size=32) if layout == "retraction" else {}
    expected, _ = await _run(agreeing_ckpt, prompts, params_list, spec=False, **overrides)
    got, stats = await _run(agreeing_ckpt, prompts, params_list, spec=True, **overrides)
    greedy = [0, 2, 3]
    assert [got[i] for i in greedy] == [expected[i] for i in greedy]
    assert len(got[1]) == SEEDED.max_new_tokens
    assert 0 < stats.spec_accepted_tokens < stats.spec_drafted_tokens
    if layout == "retraction":
        assert stats.total_retractions > 0


async def test_nextn_keeps_greedy_output_with_prefix_cache_hits(agreeing_ckpt) -> None:
    base = random_prompts([40], seed=11)[0]
    prompts = [base, base[:32] + random_prompts([9], seed=13)[0], base, random_prompts([17], seed=12)[0]]

    async def in_turn(spec: bool):
        engine = start_engine(agreeing_ckpt, page_size=8, **({"speculative": NEXTN} if spec else {}))
        try:
            got = [(await _outputs(engine, [p], [GREEDY]))[0] for p in prompts]
            stats = engine.stats()
        finally:
            engine.shutdown()
        assert stats.used_pages == 0
        return got, stats

    expected, _ = await in_turn(False)
    got, stats = await in_turn(True)
    assert got == expected
    assert stats.spec_accepted_tokens > 0 and stats.prefix_hit_tokens > 0


def test_nextn_without_the_mtp_layer_is_refused_naming_why(tmp_path) -> None:
    ckpt = write_tiny_model(tmp_path / "no-mtp", preset="tiny-deepseek", seed=0, num_nextn_predict_layers=0)
    config = EngineConfig(model_path=str(ckpt), num_pages=64, speculative=NEXTN)
    with pytest.raises(ValueError, match="num_nextn_predict_layers 0"):
        Engine.load(config)
    raw = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": 1}))
    with pytest.raises(ValueError, match=r"no model\.layers\.4\.eh_proj\.weight"):
        Engine.load(config)


def test_vllm_speculative_config_maps_onto_the_flags_and_refuses_naming_the_key() -> None:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, SpeculativeConfig)
    args = parser.parse_args(["--speculative-config",
                              '{"method": "deepseek_mtp", "num_speculative_tokens": 3}'])
    config = config_from_args(SpeculativeConfig, args)
    assert (config.speculative_algorithm, config.max_drafts) == ("NEXTN", 3)
    assert config.agreed() == SpeculativeConfig(speculative_algorithm="NEXTN",
                                                speculative_num_draft_tokens=4).agreed()
    draft = SpeculativeConfig(speculative_config='{"method": "draft_model", "model": "/m", '
                                                 '"num_speculative_tokens": 2}')
    assert (draft.speculative_algorithm, draft.speculative_draft_model_path, draft.max_drafts) == \
        ("STANDALONE", "/m", 2)
    ngram = SpeculativeConfig(speculative_config='{"method": "ngram", "prompt_lookup_max": 3}')
    assert (ngram.speculative_algorithm, ngram.speculative_ngram_max_match) == ("NGRAM", 3)
    for text, named in [('{"method": "eagle3"}', "method 'eagle3'"),
                        ('{"method": "ngram", "draft_tensor_parallel_size": 2}',
                         "'draft_tensor_parallel_size'"),
                        ('{"method": "deepseek_mtp", "model": "/m"}', "key 'model'"),
                        ('{"method": "ngram", "num_speculative_tokens": 40}', "must be 2..16"),
                        ("[1]", "JSON object")]:
        with pytest.raises(ValueError, match=re.escape(named)):
            SpeculativeConfig(speculative_config=text)
    with pytest.raises(ValueError, match="--speculative-algorithm NGRAM was given"):
        SpeculativeConfig(speculative_algorithm="NGRAM", speculative_config='{"method": "deepseek_mtp"}')


async def test_nextn_decode_drafts_from_the_prompt_kv_prefill_sent(agreeing_ckpt) -> None:
    """Prefill writes the MTP layer's prompt K/V into the pages it reports (copied here as the transfer
    would): decode's output equals colocated, and its drafts are accepted about as often (without the
    prompt's MTP K/V about a tenth are). The 33-token prompt's first chunk stops one token short, so
    its last prompt token runs as a decode on the prefill side, which must still give one token."""
    engines = [start_engine(agreeing_ckpt, chunked_prefill_size=32, num_pages=128, speculative=NEXTN)
               for _ in range(2)]
    prefill, decode = engines
    try:
        for i, prompt in enumerate(random_prompts([17, 70, 130, 33], seed=11)):
            got = await disaggregated(prefill, decode, prompt, GREEDY, f"pd{i}")
            expected = await colocated(prefill, prompt, GREEDY, f"co{i}")
            assert got == expected, f"prompt of {len(prompt)} tokens"
        stats = decode.stats()
        assert stats.spec_accepted_tokens > 0.6 * stats.spec_drafted_tokens
        assert prefill.stats().used_pages == 0 and stats.used_pages == 0
    finally:
        for engine in engines:
            engine.shutdown()
