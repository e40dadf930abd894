"""Greedy output and logprobs with the prefix cache on equal those with it off, on the tiny
checkpoint: colocated and PD (the in-process PD path of test_pd_hooks.py, with decode-side
reuse), on prompts sharing prefixes of every length around page boundaries, under eviction
pressure and with retraction. Tokens must be identical, and with the C++ kernels logprobs too, bit
for bit: their attention sums follow token positions, so a suffix computed against cached K/V
gives what computing the whole prompt gives. Where that cannot hold (the torch ops, whose SDPA
splits differently by chunk; a retracted request, whose generated tokens are recomputed by the
extend kernel instead of the decode kernel) logprobs agree to 1e-4.
"""

from __future__ import annotations

import asyncio

import pytest

from engine.sampling import SamplingParams
from kernels import cpu_kernels, ops
from tests.engine.conftest import generate, prefill_first_token, random_prompts, start_engine

PAGE = 16
GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True, logprobs=True, top_logprobs=2)
SHARED = [1, PAGE - 1, PAGE, PAGE + 1, 2 * PAGE - 1, 2 * PAGE, 2 * PAGE + 1, 3 * PAGE]


def prompt_family(seed: int) -> list[list[int]]:
    """Prompts sharing a prefix of every length in SHARED with a base prompt, then the base itself
    again (fully cached, page-aligned and not), in an order that makes later ones hit."""
    base = random_prompts([3 * PAGE + 5], seed=seed)[0]
    tails = random_prompts([7] * len(SHARED), seed=seed + 1)
    return [base] + [base[:n] + tail for n, tail in zip(SHARED, tails, strict=True)] + \
        [base, base[:2 * PAGE], base[:2 * PAGE], base[:PAGE + 1]]


async def colocated(engine, prompt, params, room):
    return [(o.token_id, o.logprob, tuple(t for t, _ in o.top_logprobs))
            async for o in generate(engine, prompt, params, room)]


def assert_same(got, expected, what: str, bitwise: bool = True) -> None:
    assert [t for t, _, _ in got] == [t for t, _, _ in expected], what
    assert [top for _, _, top in got] == [top for _, _, top in expected], what
    for (_, lp, _), (_, ref, _) in zip(got, expected, strict=True):
        if bitwise and cpu_kernels.available():
            # The C++ kernels' sums follow token positions, not chunk or batch boundaries: a prefix
            # attended from cached pages gives exactly what computing it again gives.
            assert lp == ref, what
        else:
            assert lp == pytest.approx(ref, abs=1e-4), what


@pytest.fixture(scope="module")
def reference(qwen3_ckpt):
    engine = start_engine(qwen3_ckpt, chunked_prefill_size=64, num_pages=256, page_size=PAGE,
                          disable_radix_cache=True)
    yield engine
    engine.shutdown()


async def expected_outputs(reference, prompts, params=GREEDY):
    return [await colocated(reference, p, params, f"ref{i}") for i, p in enumerate(prompts)]


async def test_colocated_cache_on_equals_off(qwen3_ckpt, reference):
    prompts = prompt_family(seed=21)
    expected = await expected_outputs(reference, prompts)
    engine = start_engine(qwen3_ckpt, chunked_prefill_size=64, num_pages=256, page_size=PAGE)
    try:
        for i, prompt in enumerate(prompts):
            assert_same(await colocated(engine, prompt, GREEDY, f"seq{i}"), expected[i], f"prompt {i}")
        stats = engine.stats()
        assert stats.prefix_hit_tokens > 0 and stats.used_pages == 0
        # The same prompts at once: they share pages cached by each other as they run.
        got = await asyncio.gather(*(colocated(engine, p, GREEDY, f"par{i}") for i, p in enumerate(prompts)))
        for i in range(len(prompts)):
            assert_same(got[i], expected[i], f"prompt {i}, concurrent")
        assert engine.stats().used_pages == 0
    finally:
        engine.shutdown()


async def test_eviction_pressure_and_retraction(qwen3_ckpt, reference):
    # 12 pages of 16 tokens: a few requests fill the pool, idle pages are evicted all the time,
    # and running requests retract each other while decoding.
    prompts = prompt_family(seed=31)[:8]
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True, logprobs=True, top_logprobs=2)
    expected = await expected_outputs(reference, prompts, params)
    engine = start_engine(qwen3_ckpt, chunked_prefill_size=64, num_pages=12, page_size=PAGE)
    try:
        got = await asyncio.gather(*(colocated(engine, p, params, f"r{i}") for i, p in enumerate(prompts)))
        for i in range(len(prompts)):
            # bitwise=False: a retracted request recomputes its generated tokens as a prompt, and
            # the extend kernel rounds a position differently from the decode kernel.
            assert_same(got[i], expected[i], f"prompt {i}", bitwise=False)
        for i, prompt in enumerate(prompts):  # one at a time too: hits on what survived eviction
            assert_same(await colocated(engine, prompt, params, f"s{i}"), expected[i], f"prompt {i} again",
                        bitwise=False)
        stats = engine.stats()
        assert stats.total_retractions > 0 and stats.prefix_evicted_pages > 0 and stats.prefix_hit_tokens > 0
        assert stats.used_pages == 0 and engine.allocator.free_pages == 12
    finally:
        engine.shutdown()


@pytest.mark.parametrize("prefill_pages,decode_pages", [(128, 128), (5, 8)], ids=["roomy", "evicting"])
async def test_pd_with_prefill_cache_and_decode_reuse_equals_off(qwen3_ckpt, reference, prefill_pages,
                                                                 decode_pages):
    prompts = prompt_family(seed=41)
    expected = await expected_outputs(reference, prompts)
    prefill = start_engine(qwen3_ckpt, chunked_prefill_size=32, num_pages=prefill_pages, page_size=PAGE)
    decode = start_engine(qwen3_ckpt, chunked_prefill_size=32, num_pages=decode_pages, page_size=PAGE)
    copied = []
    try:
        assert decode.reserve("spacer", 40) is not None  # page ids differ between the two sides
        for i, prompt in enumerate(prompts):
            room = f"pd{i}"
            reservation = decode.reserve_prompt(room, prompt)
            written = []

            def on_pages_filled(page_ids, num_tokens, written=written):
                written[:] = page_ids

            first = await prefill_first_token(prefill, prompt, GREEDY, room, on_pages_filled)
            # Only the pages decode does not hold cross over, as the transfer would move them.
            tail = written[reservation.cached_pages:]
            if tail:
                ops.scatter_pages(decode.pool.buffer, reservation.tail,
                                  ops.gather_pages(prefill.pool.buffer, tail))
            copied.append(len(tail))
            assert prefill.release(room)
            got = [(o.token_id, o.logprob, tuple(t for t, _ in o.top_logprobs))
                   async for o in generate(decode, prompt, GREEDY, room, first_token=first)]
            assert_same(got, expected[i], f"prompt {i} ({len(prompt)} tokens, {reservation.cached_pages} "
                        "pages reused on decode)")
        assert sum(copied) < sum(-(-len(p) // PAGE) for p in prompts)  # decode reuse saved writes
        assert prefill.stats().prefix_hit_tokens > 0 and decode.stats().prefix_hit_tokens > 0
        if prefill_pages < 16:
            assert prefill.stats().prefix_evicted_pages > 0 and decode.stats().prefix_evicted_pages > 0
        assert decode.release("spacer")
        assert prefill.stats().used_pages == 0 and decode.stats().used_pages == 0
    finally:
        prefill.shutdown()
        decode.shutdown()


async def test_tensor_parallel_cache_on_equals_tp1_off(qwen3_ckpt, reference):
    # Rank 0's page manager holds the cache; followers run its plan, so each rank's head slice of a
    # cached page is there. Tolerance as in test_tp.py (TP reorders the o_proj/down sums).
    prompts = prompt_family(seed=51)
    expected = await expected_outputs(reference, prompts)
    engine = start_engine(qwen3_ckpt, chunked_prefill_size=64, num_pages=256, page_size=PAGE, tp_size=2)
    try:
        for i, prompt in enumerate(prompts):
            got = await colocated(engine, prompt, GREEDY, f"tp{i}")
            assert [t for t, _, _ in got] == [t for t, _, _ in expected[i]], f"prompt {i}"
            for (_, lp, _), (_, ref, _) in zip(got, expected[i], strict=True):
                assert lp == pytest.approx(ref, abs=1e-3), f"prompt {i}"
        stats = engine.stats()
        assert stats.prefix_hit_tokens > 0 and stats.used_pages == 0
    finally:
        engine.shutdown()
