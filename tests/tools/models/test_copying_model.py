"""tools.models.copying_model: a checkpoint whose greedy answers repeat their prompt's last tokens, in
HF transformers and in the engine, where n-gram speculation then accepts nearly every draft."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.sampling import SamplingParams
from engine.speculative.config import SpeculativeConfig
from tests.engine.conftest import generate, random_prompts, start_engine
from tools.models.copying_model import write
from tools.models.tiny_model import write_tiny_model

PERIOD = 8
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def copying_dir(tmp_path_factory) -> Path:
    tiny = write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", preset="tiny", seed=0)
    return write(tiny, tmp_path_factory.mktemp("copying") / "model", PERIOD)


def _copied(prompt: list[int]) -> list[int]:
    return (prompt[-PERIOD:] * NEW_TOKENS)[:NEW_TOKENS]


def test_hf_greedy_answers_repeat_the_prompts_last_tokens(copying_dir) -> None:
    model = AutoModelForCausalLM.from_pretrained(copying_dir, dtype=torch.float32).eval()
    for prompt in random_prompts([12, 90, 300], seed=3):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert out[0, len(prompt):].tolist() == _copied(prompt)


async def test_engine_copies_too_and_ngram_drafts_are_accepted(copying_dir) -> None:
    engine = start_engine(copying_dir, speculative=SpeculativeConfig(speculative_algorithm="NGRAM",
                                                                     speculative_num_draft_tokens=5))
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    try:
        for i, prompt in enumerate(random_prompts([40, 130], seed=4)):
            got = [o.token_id async for o in generate(engine, prompt, params, f"r{i}")]
            assert got == _copied(prompt)
        stats = engine.speculator.stats
    finally:
        engine.shutdown()
    assert stats.drafted_tokens > 0
    assert stats.accepted_tokens >= 0.9 * stats.drafted_tokens


def test_a_model_without_qk_norms_is_refused_naming_why(copying_dir, tmp_path) -> None:
    other = tmp_path / "llama"
    shutil.copytree(copying_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"model_type": "llama"}))
    with pytest.raises(SystemExit, match="only qwen3"):
        write(other, tmp_path / "out")
