"""The PD hooks in-process: prefill on one engine, copy its KV pages, decode on another.

The copy (kernels.ops gather_pages -> scatter_pages between the two engines' pools) stands in
for the transfer engine; everything else is the real path the PD services use.
"""

from __future__ import annotations

import asyncio

import pytest

from engine.outputs import FirstToken, RequestAborted
from engine.request import EngineRequest
from engine.sampling import SamplingParams
from kernels import cpu_kernels, ops
from tests.engine.conftest import generate, prefill_first_token, random_prompts, start_engine

GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=2)
LENGTHS = [1, 15, 16, 17, 70, 200]


@pytest.fixture
async def engines(qwen3_ckpt):
    prefill = start_engine(qwen3_ckpt, chunked_prefill_size=32, num_pages=128)
    decode = start_engine(qwen3_ckpt, chunked_prefill_size=32, num_pages=128)
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


async def colocated(engine, prompt, params, room):
    return [(o.token_id, o.text, o.logprob) async for o in generate(engine, prompt, params, room)]


async def disaggregated(prefill, decode, prompt, params, room, filled_calls=None):
    dst_pages = decode.reserve(room, len(prompt))
    assert dst_pages is not None

    calls = filled_calls if filled_calls is not None else []

    def on_pages_filled(page_ids, num_tokens):
        calls.append((list(page_ids), num_tokens))

    first = await prefill_first_token(prefill, prompt, params, room, on_pages_filled)
    page_ids = calls[-1][0]  # the last call names all the prompt's pages
    assert prefill.stats().used_pages >= len(page_ids)  # held until released
    src = ops.gather_pages(prefill.pool.buffer, page_ids)
    ops.scatter_pages(decode.pool.buffer, dst_pages[:len(page_ids)], src)
    assert prefill.release(room)
    assert not prefill.release(room)
    return [(o.token_id, o.text, o.logprob)
            async for o in generate(decode, prompt, params, room, first_token=first)]


async def test_prefill_transfer_decode_equals_generate(engines):
    prefill, decode = engines
    # Occupy some decode pages first so source and destination page ids differ.
    assert decode.reserve("spacer", 40) is not None
    prompts = random_prompts(LENGTHS, seed=11)
    for i, prompt in enumerate(prompts):
        calls = []
        got = await disaggregated(prefill, decode, prompt, GREEDY, f"pd{i}", calls)
        expected = await colocated(prefill, prompt, GREEDY, f"co{i}")
        assert [t for t, _, _ in got] == [t for t, _, _ in expected], f"prompt of {len(prompt)} tokens"
        assert "".join(x for _, x, _ in got) == "".join(x for _, x, _ in expected)
        for (_, _, lp), (_, _, ref) in zip(got, expected, strict=True):
            # Bit for bit with the C++ kernels (sums follow positions, not chunks or batches).
            assert lp == ref if cpu_kernels.available() else lp == pytest.approx(ref, abs=1e-4)
        # Pages are reported in order, only full ones until the end, then all of them.
        page_size = prefill.kv_layout.page_size
        assert calls[-1][1] == len(prompt)
        assert len(calls[-1][0]) == prefill.pages.pages_for(len(prompt))
        for (pages, done), (later, _) in zip(calls, calls[1:], strict=False):
            assert len(pages) * page_size <= done and later[:len(pages)] == pages
        assert len(calls) == -(-len(prompt) // 32)  # one call per 32-token chunk (2 full pages each)
    assert decode.release("spacer")
    assert prefill.stats().used_pages == 0 and decode.stats().used_pages == 0


async def test_seeded_sampling_survives_disaggregation(engines):
    prefill, decode = engines
    prompt = random_prompts([50], seed=12)[0]
    params = SamplingParams(temperature=1.0, seed=5, max_new_tokens=12, ignore_eos=True)
    got = await disaggregated(prefill, decode, prompt, params, "seeded")
    expected = await colocated(decode, prompt, params, "seeded-co")
    assert [t for t, _, _ in got] == [t for t, _, _ in expected]


async def test_prefilled_requests_survive_retraction(qwen3_ckpt):
    # A decode engine with pages for the prompts plus only a few new pages: the prefilled requests
    # retract each other and resume by recomputing locally.
    prefill = start_engine(qwen3_ckpt, num_pages=128, page_size=4)
    decode = start_engine(qwen3_ckpt, num_pages=40, page_size=4)
    try:
        prompts = random_prompts([30, 31, 29, 33], seed=13)
        params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
        got = await asyncio.gather(*(disaggregated(prefill, decode, p, params, f"r{i}")
                                     for i, p in enumerate(prompts)))
        assert decode.stats().total_retractions > 0
        for i, prompt in enumerate(prompts):
            expected = await colocated(prefill, prompt, params, f"co{i}")
            assert [t for t, _, _ in got[i]] == [t for t, _, _ in expected]
        assert decode.stats().used_pages == 0 and prefill.stats().used_pages == 0
    finally:
        prefill.shutdown()
        decode.shutdown()


async def test_reserve_refuses_when_full_and_release_frees(engines):
    _, decode = engines
    pages = decode.reserve("big", 100 * 16)
    assert pages is not None and len(pages) == 100
    assert decode.reserve("too-big", 40 * 16) is None
    with pytest.raises(ValueError):
        decode.reserve("big", 16)
    assert decode.release("big")
    assert decode.stats().used_pages == 0


async def test_abort_during_prefill_frees_pages(engines):
    prefill, _ = engines
    prompt = random_prompts([600], seed=14)[0]
    calls = []

    def on_pages_filled(page_ids, num_tokens):
        calls.append(num_tokens)
        if len(calls) == 1:
            prefill.abort("gone")

    with pytest.raises(RequestAborted):
        await prefill_first_token(prefill, prompt, GREEDY, "gone", on_pages_filled)
    assert calls[0] < len(prompt) and calls[-1] < len(prompt)
    assert prefill.stats().used_pages == 0 and prefill.stats().held_rooms == 0


async def test_failing_hook_aborts_prefill(engines):
    prefill, _ = engines

    def on_pages_filled(page_ids, num_tokens):
        raise RuntimeError("transfer failed")

    with pytest.raises(RequestAborted):
        await prefill_first_token(prefill, random_prompts([100], seed=15)[0], GREEDY, "fails",
                                  on_pages_filled)
    # Writes the hook issued before it failed may still read the pages: they stay held under the
    # room until the caller, having stopped its writes, frees them.
    assert prefill.stats().held_rooms == 1
    prefill.abort("fails")
    await _until_idle(prefill)
    assert prefill.stats().used_pages == 0 and prefill.stats().held_rooms == 0


async def _until_idle(engine) -> None:
    for _ in range(300):
        if engine.stats().used_pages == 0 and engine.stats().running == 0:
            return
        await asyncio.sleep(0.01)


async def test_cancelled_prefill_frees_pages(engines):
    prefill, _ = engines
    task = asyncio.create_task(prefill_first_token(prefill, random_prompts([600], seed=16)[0], GREEDY,
                                                   "cancel"))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _until_idle(prefill)
    assert prefill.stats().used_pages == 0 and prefill.stats().held_rooms == 0


async def test_cancelled_prefill_with_a_transfer_hook_keeps_its_pages_until_freed(engines):
    """A cancelled caller may still have writes reading the prompt's pages (queued on a transfer
    thread, or read by the engine after it said "done"): the engine must not hand the pages to
    another prompt, which would send that prompt's KV under this one's checksum, until the caller
    frees them."""
    prefill, _ = engines
    filled = asyncio.Event()
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(prefill_first_token(
        prefill, random_prompts([600], seed=17)[0], GREEDY, "cancel-hooked",
        lambda pages, tokens: loop.call_soon_threadsafe(filled.set)))
    await asyncio.wait_for(filled.wait(), 60)  # the first pages are out, a write of them may be running
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(300):
        if prefill.stats().running == 0 and prefill.stats().waiting == 0:
            break
        await asyncio.sleep(0.01)
    assert prefill.stats().running == 0, "the cancelled prefill kept computing"
    assert prefill.stats().held_rooms == 1 and prefill.stats().used_pages > 0, \
        "the engine freed pages a transfer may still be reading"
    prefill.abort("cancel-hooked")
    await _until_idle(prefill)
    assert prefill.stats().used_pages == 0 and prefill.stats().held_rooms == 0


async def test_a_prefill_only_request_streams_its_first_token_and_makes_no_text(engines, monkeypatch):
    prefill, _ = engines
    import engine.engine as engine_module

    def no_text(*args, **kwargs):
        raise AssertionError("a prefill-only request built a detokenizer")

    monkeypatch.setattr(engine_module, "text_stream", no_text)
    prompt = random_prompts([40], seed=18)[0]
    outputs = [o async for o in generate(prefill, prompt, GREEDY, "first", prefill_only=True)]
    assert len(outputs) == 1
    first = outputs[0]
    assert first.token_id >= 0 and first.text == "" and first.finish_reason == "stop"
    assert (first.prompt_tokens, first.completion_tokens) == (40, 1) and len(first.top_logprobs) == 2
    assert prefill.stats().held_rooms == 1  # held until released
    assert prefill.release("first") and prefill.stats().used_pages == 0


async def test_check_refuses_a_request_of_two_kinds(engines):
    _, decode = engines
    with pytest.raises(ValueError, match="prefill-only"):
        decode.check(EngineRequest("both", [1, 2, 3], GREEDY, first_token=FirstToken(5), prefill_only=True))
    with pytest.raises(ValueError, match="on_pages_filled"):
        decode.check(EngineRequest("hook", [1, 2, 3], GREEDY, on_pages_filled=lambda pages, tokens: None))
    with pytest.raises(ValueError, match="invalid sampling params: temperature"):
        decode.check(EngineRequest("bad", [1, 2, 3], SamplingParams(temperature=-1)))


async def test_a_refused_prefilled_request_leaves_no_page_reserved(engines):
    """A prefilled request takes over the pages reserved under its room; one the engine refuses
    frees them (its caller cannot: the reservation is the request's)."""
    _, decode = engines
    prompt = random_prompts([40], seed=19)[0]
    assert decode.reserve("short", 16) is not None  # one page for a three-page prompt
    with pytest.raises(ValueError, match="cannot hold"):
        [o async for o in generate(decode, prompt, GREEDY, "short", first_token=FirstToken(5))]
    with pytest.raises(KeyError):
        [o async for o in generate(decode, prompt, GREEDY, "none", first_token=FirstToken(5))]
    running = generate(decode, prompt, SamplingParams(temperature=0, max_new_tokens=500, ignore_eos=True),
                       "busy")
    await running.__anext__()
    assert decode.reserve("busy", len(prompt)) is not None  # a reservation under a running room
    with pytest.raises(ValueError, match="already in use"):
        [o async for o in generate(decode, prompt, GREEDY, "busy", first_token=FirstToken(5))]
    await running.aclose()
    await _until_idle(decode)
    assert decode.stats().used_pages == 0 and decode.stats().held_rooms == 0
