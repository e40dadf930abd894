"""Speculative decoding: the n-gram drafter, the draft budget, the flags, and greedy output that stays
identical to decoding without drafts (mixed batches, prefix-cache hits, retraction), every page back."""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from types import SimpleNamespace

import pytest

from engine.config import EngineConfig
from engine.sampling import SamplingParams
from engine.scheduler import Request
from engine.speculative.adaptive import MAX_PAUSE, DraftBudget
from engine.speculative.config import SpeculativeConfig
from engine.speculative.draft_model import check_vocabulary
from engine.speculative.ngram import NgramIndex
from engine.speculative.speculator import Speculator
from tests.engine.conftest import generate, random_prompts, start_engine

GREEDY = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=7, max_new_tokens=40, ignore_eos=True)
NGRAM = SpeculativeConfig(speculative_algorithm="NGRAM", speculative_num_draft_tokens=5)


def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    index = NgramIndex(min_match=1, max_match=3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # [2, 3] last occurred before the end at 5..6 (followed by 7, 8); [5, 2, 3] never did.
    assert index.propose(tokens, 2) == [7, 8]
    # past the end the copy runs over its own drafts: the run of 5 since that match, repeated
    assert index.propose(tokens, 7) == [7, 8, 5, 2, 3, 7, 8]
    assert NgramIndex(1, 2).propose([9, 4, 4], 3) == [4, 4, 4]
    tokens += [7]  # the index grows with the tokens: [2, 3, 7] now matches at 5..7
    assert index.propose(tokens, 3) == [8, 5, 2]
    assert NgramIndex(1, 3).propose([4, 5, 6], 3) == []  # the suffix never occurred before
    assert NgramIndex(1, 3).propose([4, 5, 6], 0) == []


def test_draft_budget_follows_acceptance_and_pauses_a_drafter_that_is_never_right() -> None:
    budget = DraftBudget(max_drafts=4)
    assert budget.next() == 4
    budget.record(drafted=4, accepted=1)
    assert budget.next() == 2  # one more than was accepted
    budget.record(drafted=2, accepted=2)
    assert budget.next() == 4  # all accepted: back up, capped at the most
    pauses = []
    for _ in range(40):  # never right: two misses, then a pause that doubles each time
        allowed = budget.next()
        if allowed:
            budget.record(drafted=allowed, accepted=0)
        pauses.append(allowed)
    assert pauses[:2] == [4, 2] and pauses[2:6] == [0, 0, 0, 0]
    drafting_steps = [i for i, allowed in enumerate(pauses) if allowed]
    assert drafting_steps == [0, 1, 6, 7, 16, 17, 34, 35]  # pauses of 4, 8, 16
    assert budget.next_pause <= MAX_PAUSE


def test_flags_refuse_more_than_sixteen_draft_tokens_naming_why() -> None:
    with pytest.raises(ValueError, match="at most 16|must be 2..16.*compute-bound"):
        SpeculativeConfig(speculative_algorithm="NGRAM", speculative_num_draft_tokens=17)
    with pytest.raises(ValueError, match="EAGLE"):
        SpeculativeConfig(speculative_algorithm="EAGLE")
    with pytest.raises(ValueError, match="num-steps"):
        SpeculativeConfig(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4,
                          speculative_num_steps=4)
    with pytest.raises(ValueError, match="dp-attention"):
        EngineConfig(model_path="m", tp_size=2, dp_size=2, enable_dp_attention=True, speculative=NGRAM)
    assert SpeculativeConfig(speculative_algorithm="NGRAM", speculative_num_draft_tokens=16).max_drafts == 15


def test_config_survives_the_json_a_tensor_parallel_rank_gets() -> None:
    # engine.tp.ranks sends asdict(config) as JSON; the rank rebuilds EngineConfig from it
    config = EngineConfig(model_path="m", speculative=NGRAM)
    assert EngineConfig(**json.loads(json.dumps(asdict(config)))) == config


async def _outputs(engine, prompts, params_list) -> list[list[int]]:
    async def one(i: int) -> list[int]:
        return [o.token_id async for o in generate(engine, prompts[i], params_list[i], f"r{i}")]
    return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


def _oracle(reference: dict[tuple[int, ...], list[int]]):
    """A drafter that knows the output without drafts and spoils every fourth draft, so verifies accept
    some drafts and reject others at every offset."""
    def drafter(request: Request, n: int) -> list[int]:
        known = reference.get(tuple(request.token_ids[:request.num_prompt]))
        if known is None:
            return []
        start = request.num_generated
        drafts = known[start:start + n]
        return [t + 1 if (start + i) % 4 == 3 else t for i, t in enumerate(drafts)]
    return drafter


async def _run(ckpt, prompts, params_list, *, spec: bool, drafter=None, **overrides):
    engine = start_engine(ckpt, **overrides, **({"speculative": NGRAM} if spec else {}))
    try:
        if drafter is not None:
            engine.thread.speculator = Speculator(NGRAM, engine.scheduler, engine.pages, drafter)
        got = await _outputs(engine, prompts, params_list)
        stats = engine.stats()
        speculator = engine.thread.speculator
    finally:
        engine.shutdown()
    assert stats.used_pages == 0  # no draft's page leaked
    return got, stats, speculator


@pytest.mark.parametrize("layout", ["plain", "retraction"])
async def test_verified_drafts_keep_greedy_output_in_mixed_batches(qwen3_ckpt, layout) -> None:
    prompts = random_prompts([21, 40, 9, 33], seed=5)
    params_list = [GREEDY, SEEDED, GREEDY, GREEDY]  # the seeded one decodes plainly beside verifies
    # retraction: 4-token pages, fewer than the four requests need at once
    overrides = dict(page_size=4, num_pages=40, chunked_prefill_size=32) if layout == "retraction" else {}
    expected, _, _ = await _run(qwen3_ckpt, prompts, params_list, spec=False, **overrides)
    reference = {tuple(p): out for p, out in zip(prompts, expected, strict=True)}
    got, stats, speculator = await _run(qwen3_ckpt, prompts, params_list, spec=True,
                                        drafter=_oracle(reference), **overrides)
    assert got == expected
    assert 0 < speculator.stats.accepted_tokens < speculator.stats.drafted_tokens
    if layout == "retraction":
        assert stats.total_retractions > 0


async def test_ngram_greedy_output_identical_with_prefix_cache_hits(qwen3_ckpt) -> None:
    base = random_prompts([40], seed=11)[0]
    # A prompt that repeats itself drafts from its first copy; the later ones share cached pages.
    prompts = [base + base[:20], base[:32] + base[:8], base + base[:20], random_prompts([17], seed=12)[0]]

    async def in_turn(spec: bool):
        engine = start_engine(qwen3_ckpt, **({"speculative": NGRAM} if spec else {}))
        try:
            got = [(await _outputs(engine, [p], [GREEDY]))[0] for p in prompts]
            stats = engine.stats()
            drafted = engine.speculator.stats.drafted_tokens if engine.speculator else 0
        finally:
            engine.shutdown()
        assert stats.used_pages == 0
        return got, stats, drafted

    expected, _, _ = await in_turn(False)
    got, stats, drafted = await in_turn(True)
    assert got == expected
    assert drafted > 0 and stats.prefix_hit_tokens > 0


def test_a_draft_model_of_another_vocabulary_is_refused_naming_why() -> None:
    target = SimpleNamespace(vocab_size=4096)
    tokenizer = SimpleNamespace(get_vocab=lambda: {"a": 0, "b": 1})
    with pytest.raises(ValueError, match="vocabulary has 2048 ids, the target's 4096"):
        check_vocabulary(target, SimpleNamespace(vocab_size=2048), tokenizer, tokenizer)  # type: ignore[arg-type]
    other = SimpleNamespace(get_vocab=lambda: {"a": 1, "b": 0})
    with pytest.raises(ValueError, match="maps tokens to other ids"):
        check_vocabulary(target, target, tokenizer, other)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="STANDALONE needs it"):
        SpeculativeConfig(speculative_algorithm="STANDALONE")


async def test_standalone_with_the_target_as_draft_accepts_every_draft_and_keeps_seeds(qwen3_ckpt) -> None:
    prompts = random_prompts([21, 40, 9], seed=6)
    params_list = [GREEDY, SEEDED, GREEDY]
    standalone = SpeculativeConfig(speculative_algorithm="STANDALONE", speculative_num_draft_tokens=5,
                                   speculative_draft_model_path=str(qwen3_ckpt))
    expected, _, _ = await _run(qwen3_ckpt, prompts, params_list, spec=False)
    runs = []
    for _ in range(2):
        engine = start_engine(qwen3_ckpt, speculative=standalone)
        try:
            runs.append(await _outputs(engine, prompts, params_list))
            stats = engine.stats()
            draft_pages = engine.speculator.draft_model.pages.used_pages  # type: ignore[union-attr]
        finally:
            engine.shutdown()
        assert stats.used_pages == 0 and draft_pages == 0
    for got in runs:
        assert [got[0], got[2]] == [expected[0], expected[2]]  # greedy: identical to no drafts
    assert runs[0][1] == runs[1][1] and len(runs[0][1]) == SEEDED.max_new_tokens  # seeded: reproducible
    # the draft is the target: every greedy draft is accepted (the sampled request's mostly too)
    assert stats.spec_accepted_tokens > 0.8 * stats.spec_drafted_tokens


async def test_a_prefill_whose_chunk_stops_one_token_short_samples_one_first_token(qwen3_ckpt) -> None:
    # A chunk that ends one token before the prompt's end leaves the request decode-ready (its last
    # prompt token is fed as a decode). On the prefill side of PD that decode must not verify n-gram
    # drafts: the prefill-only request has exactly one token to give, the one after its prompt.
    run = random_prompts([4], seed=21)[0]
    prompt = (run * 10)[:33]  # a repeated run: the n-gram drafter proposes its continuation
    engine = start_engine(qwen3_ckpt, speculative=NGRAM, chunked_prefill_size=32)
    try:
        outputs = [o async for o in generate(engine, prompt, GREEDY, "prefill", prefill_only=True)]
        engine.release("prefill")
        stats = engine.stats()
    finally:
        engine.shutdown()
    expected, _, _ = await _run(qwen3_ckpt, [prompt], [GREEDY], spec=False)
    assert [o.token_id for o in outputs] == expected[0][:1]
    assert stats.used_pages == 0
