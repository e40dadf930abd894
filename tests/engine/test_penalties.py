"""Penalties, logit_bias and min_tokens: greedy output equals HF transformers' generate with the
equivalent logits processors, token for token, run colocated (all cases in one batch, so rows with
and without penalties mix) and disaggregated (prefill samples the first token, decode continues).

presence/frequency penalties have no HF processor: `OpenAIPenalties` below is the reference, written
from OpenAI's formula (logit -= count * frequency + (count > 0) * presence, over output tokens).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from engine.penalties import PenaltyTable, apply_penalties
from engine.sampling import SamplingParams
from tests.engine.conftest import generate, random_prompts, start_engine
from tests.engine.test_pd_hooks import disaggregated

NEW_TOKENS = 16
EOS = 2  # the tiny preset's <|im_end|>


class OpenAIPenalties(LogitsProcessor):
    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        output = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, output, torch.ones_like(output, dtype=scores.dtype))
        return scores - counts * self.frequency - (counts > 0).to(scores.dtype) * self.presence


def bias_processor(bias: dict[int, float]) -> SequenceBiasLogitsProcessor:
    return SequenceBiasLogitsProcessor({(token,): value for token, value in bias.items()})


# (params beyond greedy, processors in the engine's order: bias, min_tokens, repetition, presence/freq).
# A +14 bias on token 100 makes greedy repeat it: the penalties' baseline (see BASELINES).
CASES: list[tuple[dict, object]] = [
    ({"repetition_penalty": 1.8}, lambda n: [RepetitionPenaltyLogitsProcessor(1.8)]),
    ({"repetition_penalty": 0.6}, lambda n: [RepetitionPenaltyLogitsProcessor(0.6)]),
    ({"logit_bias": {100: 14.0}, "presence_penalty": 1.5, "frequency_penalty": 0.7},
     lambda n: [bias_processor({100: 14.0}), OpenAIPenalties(n, 1.5, 0.7)]),
    ({"frequency_penalty": -2.0}, lambda n: [OpenAIPenalties(n, 0.0, -2.0)]),
    ({"logit_bias": {100: 8.0, 200: 6.5, 300: -100.0}},
     lambda n: [bias_processor({100: 8.0, 200: 6.5, 300: -100.0})]),
    ({"logit_bias": {EOS: 100.0}, "min_tokens": 6, "ignore_eos": False},
     lambda n: [bias_processor({EOS: 100.0}), MinNewTokensLengthLogitsProcessor(n, 6, EOS)]),
    ({"logit_bias": {100: 14.0}, "repetition_penalty": 1.3, "presence_penalty": 0.5,
      "frequency_penalty": 0.5},
     lambda n: [bias_processor({100: 14.0}), RepetitionPenaltyLogitsProcessor(1.3),
                OpenAIPenalties(n, 0.5, 0.5)]),
]
# what each case must differ from (a case equal to its baseline could not fail)
BASELINES = [{}, {}, {"logit_bias": {100: 14.0}}, {}, {}, {"logit_bias": {EOS: 100.0}, "ignore_eos": False},
             {"logit_bias": {100: 14.0}}]
PROMPTS = random_prompts([5, 17, 40, 9, 33, 12, 64], seed=21)


def params_of(case: dict) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True, **case})


@pytest.fixture(scope="module")
def reference(qwen3_ckpt) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(qwen3_ckpt, dtype=torch.float32)
    results = []
    with torch.inference_mode():
        for prompt, (case, processors) in zip(PROMPTS, CASES, strict=True):
            model.generation_config.eos_token_id = None if params_of(case).ignore_eos else EOS
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 logits_processor=LogitsProcessorList(processors(len(prompt))),  # type: ignore[operator]
                                 pad_token_id=0)
            results.append(out[0, len(prompt):].tolist())
    return results


async def test_penalties_match_hf_colocated_and_disaggregated(qwen3_ckpt, reference):
    engine = start_engine(qwen3_ckpt, chunked_prefill_size=32, num_pages=256)
    decode = start_engine(qwen3_ckpt, chunked_prefill_size=32, num_pages=256)
    try:
        async def colocated(i: int, params: SamplingParams) -> list[int]:
            return [o.token_id async for o in generate(engine, PROMPTS[i], params, f"c{i}")]

        plain = await asyncio.gather(*(colocated(i, params_of(base)) for i, base in enumerate(BASELINES)))
        got = await asyncio.gather(*(colocated(i, params_of(case)) for i, (case, _) in enumerate(CASES)))
        for i, (case, _) in enumerate(CASES):
            assert got[i] == reference[i], f"colocated, {case}"
            assert got[i] != plain[i], f"{case} changed nothing: the case cannot fail"
        # min_tokens held eos off for 6 tokens; the +100 bias then ends the request
        assert got[5][:6].count(EOS) == 0 and got[5][-1] == EOS and len(got[5]) == 7
        pd = await asyncio.gather(*(disaggregated(engine, decode, PROMPTS[i], params_of(case), f"pd{i}")
                                    for i, (case, _) in enumerate(CASES)))
        for i, (case, _) in enumerate(CASES):
            assert [token for token, _, _ in pd[i]] == reference[i], f"disaggregated, {case}"
        # a migrated continuation: the delivered tokens end its prompt, counted as output
        carried = 5
        rest = await asyncio.gather(*(
            colocated_continuation(engine, i, continuation(params_of(case), carried), reference[i][:carried])
            for i, (case, _) in enumerate(CASES) if len(reference[i]) > carried))
        assert rest == [r[carried:] for r in reference if len(r) > carried]
        assert engine.thread.constraints.table is not None and len(engine.thread.constraints.table) == 0
    finally:
        engine.shutdown()
        decode.shutdown()


def continuation(params: SamplingParams, carried: int) -> SamplingParams:
    """What the gateway's migration sends on (services/gateway/migration.py continuation_sampling)."""
    return replace(params, max_new_tokens=params.max_new_tokens - carried,
                   min_tokens=max(0, params.min_tokens - carried))


async def colocated_continuation(engine, i: int, params: SamplingParams, delivered: list[int]) -> list[int]:
    return [o.token_id async for o in generate(engine, PROMPTS[i] + delivered, params, f"m{i}",
                                               carried_tokens=len(delivered))]


def test_penalty_rows_leave_other_rows_alone_and_slots_are_reused() -> None:
    table = PenaltyTable(8, torch.device("cpu"))
    first = table.slot("a", [1, 2, 3, 3], output_start=2)
    assert table.counts[first].tolist() == [0, 0, 0, 2, 0, 0, 0, 0]
    assert table.in_prompt[first].tolist() == [False, True, True] + [False] * 5
    logits = torch.ones(3, 8)
    out = apply_penalties(logits, torch.tensor([1]), torch.tensor([first]), table,
                          [SamplingParams(frequency_penalty=0.5)], [2], [frozenset()])
    assert out[0].tolist() == [1.0] * 8 and out[2].tolist() == [1.0] * 8
    assert out[1].tolist() == [1, 1, 1, 0, 1, 1, 1, 1]
    table.add_tokens(torch.tensor([first]), torch.tensor([5]))
    assert int(table.counts[first, 5]) == 1
    table.release("a")
    assert table.slot("b", [4], output_start=1) == first and int(table.counts[first].sum()) == 0
