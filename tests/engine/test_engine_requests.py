"""Engine behaviours end to end on the tiny checkpoint: sampling, stop conditions, logprobs, aborts."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from engine.outputs import TokenOutput
from engine.request import EngineRequest
from engine.sampling import SamplingParams
from tests.engine.conftest import generate, random_prompts, start_engine

GREEDY = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)


@pytest.fixture
async def engine(qwen3_ckpt):
    engine = start_engine(qwen3_ckpt, chunked_prefill_size=64, num_pages=128)
    yield engine
    engine.shutdown()


async def collect(engine, prompt, params, room) -> list[TokenOutput]:
    return [output async for output in generate(engine, prompt, params, room)]


def tokens_of(outputs: list[TokenOutput]) -> list[int]:
    return [o.token_id for o in outputs]


def text_of(outputs: list[TokenOutput]) -> str:
    return "".join(o.text for o in outputs)


async def test_max_new_tokens_and_counts(engine):
    prompt = random_prompts([12], seed=1)[0]
    outputs = await collect(engine, prompt, GREEDY, "a")
    assert len(outputs) == 16
    assert [o.finish_reason for o in outputs] == [None] * 15 + ["length"]
    assert [o.completion_tokens for o in outputs] == list(range(1, 17))
    assert {o.prompt_tokens for o in outputs} == {12}
    assert all(o.logprob is None and o.top_logprobs == [] for o in outputs)
    assert text_of(outputs) == engine.tokenizer.decode(tokens_of(outputs), skip_special_tokens=True)


async def test_seed_reproducible_regardless_of_batch(engine):
    prompt, *others = random_prompts([20, 5, 40, 9], seed=2)
    params = SamplingParams(temperature=1.0, seed=1234, max_new_tokens=16, ignore_eos=True)
    alone = tokens_of(await collect(engine, prompt, params, "alone"))
    noisy = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True)
    batched = await asyncio.gather(
        collect(engine, prompt, params, "seeded"),
        *(collect(engine, p, noisy, f"other{i}") for i, p in enumerate(others)))
    assert tokens_of(batched[0]) == alone
    other_seed = tokens_of(await collect(engine, prompt, SamplingParams(
        temperature=1.0, seed=99, max_new_tokens=16, ignore_eos=True), "seed99"))
    assert other_seed != alone
    greedy = tokens_of(await collect(engine, prompt, GREEDY, "greedy"))
    assert alone != greedy  # temperature 1 actually samples


async def test_stop_string_cuts_text(engine):
    prompt = random_prompts([10], seed=3)[0]
    full = await collect(engine, prompt, GREEDY, "full")
    text = text_of(full)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), f"pick a printable stop string from {text!r}"
    outputs = await collect(engine, prompt, SamplingParams(temperature=0, max_new_tokens=16,
                                                           ignore_eos=True, stop=[stop]), "stopped")
    assert outputs[-1].finish_reason == "stop"
    assert text_of(outputs) == text[:text.index(stop)]
    assert len(outputs) < len(full)


async def test_stop_token_ids(engine):
    prompt = random_prompts([10], seed=4)[0]
    full = tokens_of(await collect(engine, prompt, GREEDY, "full"))
    stop_token = full[6]
    outputs = await collect(engine, prompt, SamplingParams(
        temperature=0, max_new_tokens=16, ignore_eos=True, stop_token_ids=[stop_token]), "stopped")
    assert tokens_of(outputs) == full[:full.index(stop_token) + 1]
    assert outputs[-1].finish_reason == "stop"


async def test_eos_and_ignore_eos(qwen3_ckpt, tmp_path):
    # Make the 4th greedy token the checkpoint's end-of-sequence token via generation_config.
    prompt = random_prompts([10], seed=5)[0]
    probe = start_engine(qwen3_ckpt)
    try:
        full = tokens_of(await collect(probe, prompt, GREEDY, "probe"))
    finally:
        probe.shutdown()
    eos = full[3]
    model_dir = tmp_path / "eos-model"
    shutil.copytree(qwen3_ckpt, model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    engine = start_engine(model_dir)
    try:
        stopped = await collect(engine, prompt, SamplingParams(temperature=0, max_new_tokens=16), "eos")
        ignored = await collect(engine, prompt, GREEDY, "ignore")
    finally:
        engine.shutdown()
    assert tokens_of(stopped) == full[:full.index(eos) + 1]
    assert stopped[-1].finish_reason == "stop"
    assert tokens_of(ignored) == full and ignored[-1].finish_reason == "length"


async def test_logprobs_and_top_logprobs(engine):
    prompt = random_prompts([8], seed=6)[0]
    outputs = await collect(engine, prompt, SamplingParams(
        temperature=0, max_new_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=5), "lp")
    for output in outputs:
        assert len(output.top_logprobs) == 5
        ids = [i for i, _ in output.top_logprobs]
        values = [v for _, v in output.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert ids[0] == output.token_id  # greedy picks the top-1
        assert output.logprob == pytest.approx(values[0])
    only_chosen = await collect(engine, prompt, SamplingParams(
        temperature=0, max_new_tokens=3, ignore_eos=True, logprobs=True), "lp0")
    assert all(o.logprob is not None and o.top_logprobs == [] for o in only_chosen)


async def test_abort_frees_pages(engine):
    prompt = random_prompts([100], seed=7)[0]
    params = SamplingParams(temperature=0, max_new_tokens=1500, ignore_eos=True)
    outputs = []
    async for output in generate(engine, prompt, params, "long"):
        outputs.append(output)
        if len(outputs) == 3:
            assert engine.stats().used_pages > 0
            engine.abort("long")
    assert outputs[-1].finish_reason == "abort" and outputs[-1].token_id == -1
    assert engine.stats().used_pages == 0
    assert engine.allocator.free_pages == engine.allocator.num_pages


async def test_leaving_the_stream_early_aborts(engine):
    prompt = random_prompts([30], seed=8)[0]
    stream = generate(engine, prompt, SamplingParams(temperature=0, max_new_tokens=1500, ignore_eos=True),
                      "quit")
    async for _ in stream:
        break
    await stream.aclose()
    for _ in range(200):
        if engine.stats().running == 0 and engine.stats().used_pages == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.stats().used_pages == 0 and engine.stats().running == 0


async def test_rejects_bad_requests(engine):
    prompt = random_prompts([5], seed=9)[0]
    with pytest.raises(ValueError, match="temperature"):
        await collect(engine, prompt, SamplingParams(temperature=-1), "bad")
    with pytest.raises(ValueError, match="KV pool"):
        await collect(engine, prompt, SamplingParams(max_new_tokens=100_000), "huge")
    with pytest.raises(ValueError, match="at least one token"):
        await collect(engine, [], GREEDY, "empty")
    first = generate(engine, prompt, SamplingParams(temperature=0, max_new_tokens=500, ignore_eos=True),
                     "dup")
    await first.__anext__()
    with pytest.raises(ValueError, match="already in use"):
        await collect(engine, prompt, GREEDY, "dup")
    await first.aclose()


async def test_generate_groups_outputs_the_caller_has_not_read(qwen3_ckpt):
    engine = start_engine(qwen3_ckpt)
    try:
        params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
        batches = engine.generate(engine.check(EngineRequest("batched", list(range(10, 30)), params)))
        first = await batches.__anext__()
        await asyncio.sleep(0.5)  # the engine runs ahead while this caller does not read
        rest = [batch async for batch in batches]
        tokens = [out.token_id for batch in [first, *rest] for out in batch]
        assert len(tokens) == 12 and rest[-1][-1].finish_reason == "length"
        assert max(len(batch) for batch in rest) > 1  # what queued up came as one item
        plain = [out.token_id async for out in generate(engine, list(range(10, 30)), params, "plain")]
        assert plain == tokens
    finally:
        engine.shutdown()
