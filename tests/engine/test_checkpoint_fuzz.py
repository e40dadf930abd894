"""Checkpoint fuzzer: random configs of every supported text architecture, each written by transformers'
own save_pretrained and served in process, greedy fp32 tokens equal to transformers' generate.

Draws come round-robin over the architectures (tests/engine/checkpoint_draws.py) from one seeded
generator (PDSERVE_FUZZ_SEED, 0 by default) until the time budget is spent: about 35 s in `make test`,
`--long` runs 400 s. Every mismatch is collected and reported with its architecture, draw number and
config, so a failing run names what to rebuild; the counts are printed (`-s` shows them).
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import time
from pathlib import Path

import pytest
import torch

from engine.sampling import SamplingParams
from tests.engine.checkpoint_draws import DRAWERS, draw
from tests.engine.conftest import generate, random_prompts, start_engine
from tools.models.saved_checkpoint import save_random_checkpoint, write_tokenizer_files

NEW = 6
GREEDY = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return write_tokenizer_files(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture
def one_thread():
    # Tiny matmuls on a shared 2-core machine: two intra-op threads wait on each other about 80x
    # longer than one thread computes.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def hf_tokens(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def engine_tokens(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    # chunks of 16 over 8-token pages: prompts longer than a chunk prefill in pieces
    engine = start_engine(model_dir, page_size=8, chunked_prefill_size=16, num_pages=64, num_threads=1)

    async def run(prompt: list[int], room: str) -> list[int]:
        return [o.token_id async for o in generate(engine, prompt, GREEDY, room)]

    try:
        return [asyncio.run(run(p, f"r{i}")) for i, p in enumerate(prompts)]
    finally:
        engine.shutdown()


def fuzz(tokenizer_dir: Path, work: Path, budget_s: float, seed: int) -> None:
    rng = random.Random(seed)
    architectures = sorted(DRAWERS)
    tried: dict[str, int] = dict.fromkeys(architectures, 0)
    mismatches = []
    deadline = time.monotonic() + budget_s
    index = 0
    # every architecture at least once, then round-robin until the budget is spent
    while index < len(architectures) or time.monotonic() < deadline:
        architecture = architectures[index % len(architectures)]
        config = draw(architecture, rng)
        folder = save_random_checkpoint(work / f"draw{index}", config, seed=rng.randrange(1 << 30),
                                        tokenizer_dir=tokenizer_dir)
        prompts = random_prompts([rng.randint(3, 40), rng.randint(3, 12)], seed=rng.randrange(1 << 30))
        expected = hf_tokens(folder, prompts)
        try:
            got = engine_tokens(folder, prompts)
        except Exception as exc:  # a checkpoint HF serves must load here too: collected, not fatal
            got = f"{type(exc).__name__}: {exc}"
        if got != expected:
            mismatches.append(f"draw {index} ({architecture}): engine {got} != HF {expected}\n"
                              f"  {config.to_diff_dict()}")
        tried[architecture] += 1
        shutil.rmtree(folder)
        index += 1
    print(f"\ncheckpoint fuzz (seed {seed}): {index} configs over {len(architectures)} architectures, "
          f"{index - len(mismatches)} equal to HF; per architecture {tried}")
    assert not mismatches, "\n".join(mismatches)


def _seed() -> int:
    return int(os.environ.get("PDSERVE_FUZZ_SEED", "0"))


def test_random_checkpoints_match_transformers(tokenizer_dir, tmp_path, one_thread):
    fuzz(tokenizer_dir, tmp_path, budget_s=35, seed=_seed())


@pytest.mark.long
def test_random_checkpoints_match_transformers_long(tokenizer_dir, tmp_path, one_thread):
    fuzz(tokenizer_dir, tmp_path, budget_s=400, seed=_seed() + 1)
