"""The engine's step clock (engine/step_clock.py): every step is counted once under its kind, so the
serving-cost account can tell decode time from the prefill that running requests wait for."""

from __future__ import annotations

import asyncio

from engine.sampling import SamplingParams
from engine.step_clock import StepClock
from tests.engine.conftest import generate, random_prompts, start_engine


def test_kind_of_a_step():
    assert StepClock.kind_of(3, 0) == "decode"
    assert StepClock.kind_of(3, 1) == "mixed"
    assert StepClock.kind_of(0, 2) == "prefill"


async def _tokens(engine, prompt, params, room) -> int:
    return len([out async for out in generate(engine, prompt, params, room)])


async def test_every_step_is_timed_under_its_kind(qwen3_ckpt):
    # Chunks of 16 tokens: the long prompt's chunks run while the short request decodes (mixed steps).
    engine = start_engine(qwen3_ckpt, chunked_prefill_size=16)
    try:
        short, long = random_prompts([5, 120], seed=3)
        params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
        alone = await _tokens(engine, short, params, "alone")
        clock = engine.step_clock
        # Alone: one prefill step (the whole prompt, which also samples the first token), then decode steps.
        assert clock.steps == {"decode": alone - 1, "mixed": 0, "prefill": 1}
        first = asyncio.ensure_future(_tokens(engine, short, params, "first"))
        while engine.stats().running == 0:
            await asyncio.sleep(0.001)
        await asyncio.gather(first, _tokens(engine, long, params, "second"))
        assert clock.steps["mixed"] > 0
        assert sum(clock.steps.values()) == engine.stats().steps
        assert all(clock.seconds[kind] > 0 for kind in clock.steps if clock.steps[kind])
        # every decoded token counted once, with the seconds of the step that made it
        decoded = clock.decode_tokens
        # each request's first token came from its prefill
        assert decoded == sum(n - 1 for n in (alone, 24, 24))
        assert 0 < clock.decode_token_seconds <= decoded * max(clock.seconds.values())
    finally:
        engine.shutdown()
