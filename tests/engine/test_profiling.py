"""--profile-prefill / --profile-decode on a real tiny engine: one bounded trace, labelled steps, and
serving unharmed when the profiler fails."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from engine import profiling
from engine.config import EngineConfig
from engine.profiling import step_kind, step_label
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledChunk, SchedulerOutput
from tests.engine.conftest import generate, random_prompts, start_engine

# 40-token prompts in 16-token chunks: three prefill steps per prompt, then decode steps.
CHUNK = 16
GREEDY = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)


async def run_requests(engine, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's tokens, one request after the other; the engine is shut down after them, so
    every trace it will write is written."""
    tokens = []
    try:
        for index, prompt in enumerate(prompts):
            tokens.append([o.token_id async for o in generate(engine, prompt, GREEDY, f"room{index}")])
        return tokens
    finally:
        engine.shutdown()


def step_labels(trace_dir: Path) -> list[str]:
    """The step slices of the one trace file in `trace_dir`."""
    files = list(trace_dir.iterdir())
    assert len(files) == 1, files
    trace = json.loads(files[0].read_text())
    return [event["name"] for event in trace["traceEvents"]
            if event.get("name", "").startswith(("prefill step", "decode step"))]


async def test_profile_prefill_records_the_bounded_prefill_steps(qwen3_ckpt, tmp_path):
    engine = start_engine(qwen3_ckpt, chunked_prefill_size=CHUNK, profile_prefill=True, profile_steps=4,
                          profile_dir=str(tmp_path))
    await run_requests(engine, random_prompts([40, 40], seed=1))
    labels = step_labels(tmp_path)
    prefill = [label for label in labels if label.startswith("prefill step")]
    # Request 0's three chunks, its decodes (in the trace, not counted), then request 1's first chunk.
    assert prefill == ["prefill step 1: 1 chunk, 16 tokens", "prefill step 2: 1 chunk, 16 tokens",
                       "prefill step 3: 1 chunk, 8 tokens", "prefill step 9: 1 chunk, 16 tokens"]
    assert all(label.startswith("decode step") and label.endswith("batch 1") for label in labels[3:-1])
    assert not engine.thread.profiler.active
    assert next(tmp_path.iterdir()).name.startswith("prefill-")


async def test_profile_decode_records_decode_steps_only(qwen3_ckpt, tmp_path):
    engine = start_engine(qwen3_ckpt, chunked_prefill_size=CHUNK, profile_decode=True, profile_steps=3,
                          profile_dir=str(tmp_path))
    await run_requests(engine, random_prompts([40], seed=2))
    assert step_labels(tmp_path) == ["decode step 1: batch 1", "decode step 2: batch 1",
                                     "decode step 3: batch 1"]
    assert next(tmp_path.iterdir()).name.startswith("decode-")


async def test_no_profile_flag_starts_no_profiler(qwen3_ckpt, tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(profiling, "profile", lambda **kwargs: started.append(kwargs))
    engine = start_engine(qwen3_ckpt, chunked_prefill_size=CHUNK, profile_dir=str(tmp_path))
    assert not engine.thread.profiler.active
    await run_requests(engine, random_prompts([40], seed=3))
    assert started == []
    assert list(tmp_path.iterdir()) == []


async def test_a_failing_profiler_leaves_generation_correct(qwen3_ckpt, tmp_path, monkeypatch, caplog):
    prompts = random_prompts([40, 20], seed=4)
    expected = await run_requests(start_engine(qwen3_ckpt, chunked_prefill_size=CHUNK), prompts)

    def fail(self, path):
        raise OSError("disk full")

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", fail)
    engine = start_engine(qwen3_ckpt, chunked_prefill_size=CHUNK, profile_prefill=True, profile_steps=2,
                          profile_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="engine.profiling"):
        assert await run_requests(engine, prompts) == expected
    assert not engine.thread.profiler.active
    assert any("could not write the profile" in r.getMessage() and "disk full" in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING)


def test_a_mixed_step_counts_as_prefill():
    decode = ScheduledChunk("a", [5], 40, [0, 1, 2], sample=True)
    chunk = ScheduledChunk("b", list(range(30)), 0, [3, 4], sample=False)
    assert step_kind(SchedulerOutput(decodes=[decode])) == "decode"
    mixed = SchedulerOutput(decodes=[decode], extends=[chunk])
    assert step_kind(mixed) == "prefill"
    assert step_label("prefill", 2, mixed) == "prefill step 2: 1 chunk, 30 tokens, 1 decode"


def test_environment_knobs_set_the_flags_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_PROFILE_PREFILL", "1")
    monkeypatch.setenv("PDSERVE_PROFILE_DECODE", "1")
    monkeypatch.setenv("PDSERVE_PROFILE_STEPS", "7")
    monkeypatch.setenv("PDSERVE_PROFILE_DIR", str(tmp_path))
    config = EngineConfig(model_path="unused")
    assert (config.profile_prefill, config.profile_decode, config.profile_steps, config.profile_dir) == \
        (True, True, 7, str(tmp_path))
    with pytest.raises(ValueError, match="--profile-steps"):
        EngineConfig(model_path="unused", profile_steps=0)


def test_one_engine_per_process_is_profiled(tmp_path):
    # DP attention's member engines share a process, and torch has one profiler per process.
    first, second = (profiling.StepProfiler(frozenset({"decode"}), 1, str(tmp_path / name),
                                            torch.device("cpu"))
                     for name in ("first", "second"))
    batch = SchedulerOutput(decodes=[ScheduledChunk("a", [5], 3, [0], sample=True)])

    def step(profiler):
        return lambda _batch: profiler.run(batch, lambda _: True)  # the other engine steps meanwhile

    assert first.run(batch, step(second)) is True
    assert not first.active and not second.active
    assert [p.name for p in tmp_path.iterdir()] == ["first"]
