"""Checkpoints and engines shared by the engine tests (built once per session, on local disk)."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.outputs import FirstToken, RequestAborted, TokenOutput
from engine.request import EngineRequest
from engine.sampling import SamplingParams
from tools.models.agreeing_mtp import make_mtp_agree
from tools.models.tiny_model import write_tiny_model

# A Llama checkpoint unlike the Qwen3 preset on every switch the decoder has: head_dim 48 with
# hidden 256 / 4 heads (so head_dim != hidden / heads), GQA ratio 4 (one KV head), untied
# embeddings, Llama-3.1 rope scaling, no q/k norm.
LLAMA_OVERRIDES = dict(
    head_dim=48, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
    rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 256},
)


@pytest.fixture(scope="session")
def qwen3_ckpt(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("ckpt") / "qwen3", preset="tiny", seed=0)


@pytest.fixture(scope="session")
def llama_ckpt(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("ckpt") / "llama", preset="tiny", seed=1, arch="llama",
                            **LLAMA_OVERRIDES)


@pytest.fixture(scope="session")
def deepseek_ckpt(tmp_path_factory) -> Path:
    """tiny-deepseek with its MTP layer (random: NEXTN's drafts practically never accepted)."""
    return write_tiny_model(tmp_path_factory.mktemp("ckpt") / "deepseek", preset="tiny-deepseek", seed=0)


@pytest.fixture(scope="session")
def agreeing_ckpt(deepseek_ckpt, tmp_path_factory) -> Path:
    """deepseek_ckpt with its MTP layer made to nearly agree with the target (tools.models.agreeing_mtp):
    NEXTN's verifies both accept and reject drafts."""
    out = tmp_path_factory.mktemp("ckpt") / "agreeing"
    shutil.copytree(deepseek_ckpt, out)
    return make_mtp_agree(out)


def start_engine(model_dir: Path, **overrides) -> Engine:
    """A started engine on `model_dir`; the caller shuts it down."""
    engine = Engine.load(EngineConfig(model_path=str(model_dir), **{"num_pages": 256, **overrides}))
    engine.start()
    return engine


def random_prompts(lengths: list[int], seed: int, vocab: int = 4000) -> list[list[int]]:
    # Ids from 10 up avoid the tokenizer's special tokens at the low end.
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (n,), generator=generator).tolist() for n in lengths]


async def generate(engine: Engine, prompt: list[int], params: SamplingParams, room: str,
                   **kind) -> AsyncIterator[TokenOutput]:
    """A request checked as a worker checks it, then its outputs one at a time (Engine.generate
    yields them in lists). `kind`: EngineRequest's first_token, prefill_only, on_pages_filled."""
    request = engine.check(EngineRequest(room, list(prompt), params, **kind))
    async with aclosing(engine.generate(request)) as batches:
        async for batch in batches:
            for output in batch:
                yield output


async def run_in_turn(engine: Engine, prompts: list[list[int]],
                      params: SamplingParams) -> list[tuple[list[int], list[float]]]:
    """Each prompt's tokens and logprobs, one request after another (so later prompts can hit the
    prefix cache the earlier ones filled)."""
    got = []
    for i, prompt in enumerate(prompts):
        outputs = [o async for o in generate(engine, prompt, params, f"r{i}")]
        got.append(([o.token_id for o in outputs], [o.logprob for o in outputs]))
    return got


async def prefill_first_token(engine: Engine, prompt: list[int], params: SamplingParams, room: str,
                  on_pages_filled=None) -> FirstToken:
    """A prefill-only request's first token (its pages stay held under `room`); RequestAborted if
    it was aborted instead."""
    outputs = [o async for o in generate(engine, prompt, params, room, prefill_only=True,
                                         on_pages_filled=on_pages_filled)]
    if outputs[-1].finish_reason == "abort":
        raise RequestAborted(f"prefill of room {room!r} was aborted")
    return FirstToken(outputs[-1].token_id, outputs[-1].logprob, outputs[-1].top_logprobs)
