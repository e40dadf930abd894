"""NEXTN with sampled requests: drafts drawn from the MTP layer's distribution, verified by rejection
sampling, keep the target's distribution; a seeded request gives the same tokens run after run.

The distribution test draws many requests at temperature 1 with top_k 2 (a vocabulary of two tokens
at each position) on a checkpoint whose MTP layer picks the target's two tokens but is far sharper
about them (the agreeing one with its head scaled up), and compares the joint frequency of the
first two tokens, the second one always verified against a draft, with the target's exact
probabilities from HF transformers on the same checkpoint. Taking every draft as it comes would
give the MTP's distribution instead, off by more than the tolerance."""

from __future__ import annotations

import asyncio
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.sampling import SamplingParams
from tests.engine.conftest import random_prompts, start_engine
from tests.engine.test_speculative import _outputs
from tests.engine.test_speculative_nextn import NEXTN

DRAWS = 600
TOP_K = 2


@pytest.fixture(scope="module")
def sharp_ckpt(agreeing_ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "sharp"
    shutil.copytree(agreeing_ckpt, out)
    weights = load_file(str(out / "model.safetensors"))
    name = next(n for n in weights if n.endswith("shared_head.norm.weight"))
    weights[name] = weights[name] * 4  # the MTP's logits 4x: as if drawn at temperature 1/4
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _target_pair_probs(ckpt: Path, prompt: list[int]) -> dict[tuple[int, int], float]:
    """P(t1, t2) under the target at temperature 1, top_k 2, from HF transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()

    def top2(ids: list[int]) -> tuple[list[int], torch.Tensor]:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        values, tokens = logits.topk(TOP_K)
        return tokens.tolist(), values.softmax(-1)

    pairs = {}
    firsts, first_probs = top2(prompt)
    for t1, p1 in zip(firsts, first_probs.tolist(), strict=True):
        seconds, second_probs = top2(prompt + [t1])
        for t2, p2 in zip(seconds, second_probs.tolist(), strict=True):
            pairs[(t1, t2)] = p1 * p2
    return pairs


async def test_sampled_nextn_keeps_the_target_distribution_and_seeds(sharp_ckpt) -> None:
    prompt = random_prompts([12], seed=3)[0]
    # three tokens: the first from the prompt, the second the first a verify can yield (one draft)
    params = [SamplingParams(temperature=1.0, top_k=TOP_K, seed=seed, max_new_tokens=3, ignore_eos=True)
              for seed in range(DRAWS)]
    engine = start_engine(sharp_ckpt, speculative=NEXTN, num_pages=1024, max_running_requests=256)
    try:
        got = await _outputs(engine, [prompt] * DRAWS, params)
        again = await _outputs(engine, [prompt] * 8, params[:8])
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert stats.used_pages == 0
    assert again == got[:8]  # seeded: the same tokens run after run
    # every request verified a draft at its second token; some drafts were rejected
    assert stats.spec_verify_rows >= DRAWS
    assert 0 < stats.spec_accepted_tokens < stats.spec_drafted_tokens
    expected = _target_pair_probs(sharp_ckpt, prompt)
    counts = Counter((tokens[0], tokens[1]) for tokens in got)
    assert set(counts) <= set(expected), f"a pair the target cannot sample: {set(counts) - set(expected)}"
    # 600 draws: a frequency's standard error is at most 0.0204, so 0.075 is over 3.5 of them (and the
    # seeds are fixed: the draws are the same each run)
    for pair, probability in expected.items():
        assert abs(counts[pair] / DRAWS - probability) < 0.075, (pair, counts[pair] / DRAWS, probability)


def test_a_sampled_request_drafts_from_the_mtp_distribution(agreeing_ckpt) -> None:
    """The drafts' distributions come with them: one row per draft, each a distribution with its
    draft in its support (top_k keeps two tokens)."""
    engine = start_engine(agreeing_ckpt, speculative=NEXTN)
    try:
        speculator = engine.speculator
        assert speculator is not None and speculator.samples
        params = SamplingParams(temperature=1.0, top_k=TOP_K, max_new_tokens=12, ignore_eos=True)
        seen: list[tuple[list[int], torch.Tensor]] = []
        accept = speculator.accept_sampled

        def spy(chunk, target_probs, generator):
            seen.append((chunk.token_ids[1:], speculator._draft_probs[chunk.room].clone()))
            return accept(chunk, target_probs, generator)
        speculator.accept_sampled = spy  # type: ignore[method-assign]
        asyncio.run(_outputs(engine, random_prompts([20], seed=4), [params]))
    finally:
        engine.shutdown()
    assert seen
    for drafts, probs in seen:
        assert probs.shape == (len(drafts), 4096)
        assert torch.allclose(probs.sum(-1), torch.ones(len(drafts)))
        assert ((probs > 0).sum(-1) == TOP_K).all()
        assert all(probs[i, token] > 0 for i, token in enumerate(drafts))
