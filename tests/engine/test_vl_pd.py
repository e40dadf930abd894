"""Qwen2-VL prefilled on one engine and decoded on another (what PD does, in process): the prefill
engine runs the vision tower in a prefill-only request with the images, its pages are copied into
the decode engine's reservation, and the decode engine continues a prefilled request that carries
the same images (for its M-RoPE positions and page salts) to the colocated engine's tokens, also
when it must retract and recompute the prompt. The decode side's `prompt_hashes` with the images are
the hashes the prefill side cached the pages under, so its reservations hit exactly.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from engine.engine_thread import Add  # the inbox command that hands the engine a request
from engine.multimodal.image_processor import ImageProcessorConfig, preprocess
from engine.outputs import FirstToken
from engine.sampling import SamplingParams
from kernels import ops
from tests.engine.conftest import generate, start_engine
from tests.engine.test_vl import PAD, chat_prompt, random_image

PAGE = 16
GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True, logprobs=True)


@pytest.fixture(scope="module")
def vl_ckpt(tmp_path_factory):
    from tools.models.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("ckpt") / "vl", preset="tiny-vl", seed=0)


@pytest.fixture(scope="module")
def tokenizer(vl_ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(vl_ckpt))


@pytest.fixture(scope="module")
def images(vl_ckpt):
    config = ImageProcessorConfig.from_dir(vl_ckpt)
    return [preprocess(random_image(130, 90, 1), config), preprocess(random_image(60, 200, 2), config),
            preprocess(random_image(130, 90, 3), config)]


async def run(engine, prompt, images, room, params=GREEDY, **kind) -> list[tuple[int, float]]:
    return [(o.token_id, o.logprob)
            async for o in generate(engine, prompt, params, room, images=tuple(images), **kind)]


async def pd_run(prefill, decode, prompt, images, room, params=GREEDY) -> list[tuple[int, float]]:
    """Prefill `prompt` with its images on `prefill`, copy its pages into `decode`'s reservation
    (made with the images' page hashes), decode there from the first token."""
    first = await pd_prefill(prefill, decode, prompt, images, room, params)
    return await run(decode, prompt, images, room, params, first_token=first)


async def pd_prefill(prefill, decode, prompt, images, room, params=GREEDY) -> FirstToken:
    """The prefill half of `pd_run`: `decode` then holds the prompt's KV under `room`."""
    reservation = decode.reserve_prompt(room, prompt, decode.prompt_hashes(prompt, images))
    written: list[int] = []
    outputs = [o async for o in generate(
        prefill, prompt, params, room, images=tuple(images), prefill_only=True,
        on_pages_filled=lambda pages, n: written.__setitem__(slice(None), pages))]
    first = FirstToken(outputs[-1].token_id, outputs[-1].logprob, outputs[-1].top_logprobs)
    skip = reservation.cached_pages
    ops.scatter_pages(decode.pool.buffer, reservation.tail,
                      ops.gather_pages(prefill.pool.buffer, written[skip:]))
    assert prefill.release(room)
    return first


def test_pd_equals_colocated_and_decode_hits_its_cache_exactly(vl_ckpt, tokenizer, images):
    one, two, other = [images[0]], images[:2], [images[2]]
    prompts = {"one": chat_prompt(tokenizer, ["Look at", "IMAGE", "what is it?"], one),
               "two": chat_prompt(tokenizer, ["compare", "IMAGE", "with", "IMAGE", "please"], two),
               "other": chat_prompt(tokenizer, ["Look at", "IMAGE", "what is it?"], other)}
    assert prompts["one"] == prompts["other"]  # same tokens, another image
    pictures = {"one": one, "two": two, "other": other}
    colocated = start_engine(vl_ckpt, page_size=PAGE, disable_radix_cache=True)
    prefill = start_engine(vl_ckpt, page_size=PAGE, chunked_prefill_size=16)  # image runs span chunks
    decode = start_engine(vl_ckpt, page_size=PAGE)
    try:
        for name, prompt in prompts.items():
            expected = asyncio.run(run(colocated, prompt, pictures[name], name))
            got = asyncio.run(pd_run(prefill, decode, prompt, pictures[name], name))
            assert [t for t, _ in got] == [t for t, _ in expected], name
            assert [lp for _, lp in got] == pytest.approx([lp for _, lp in expected], abs=1e-4), name

        prompt = prompts["one"]
        shared_text = prompt.index(PAD) // PAGE
        # "other" (same tokens, another image) reused only the text pages before the image
        for engine in (prefill, decode):
            assert engine.reserve_prompt("probe", prompt, engine.prompt_hashes(prompt, one)).cached_pages \
                == len(prompt) // PAGE
            assert engine.release("probe")
            assert engine.reserve_prompt("probe", prompt, engine.prompt_hashes(prompt, other)).cached_pages \
                == len(prompt) // PAGE
            assert engine.release("probe")
            # hashed without the images, the image pages are not found
            assert engine.reserve_prompt("probe", prompt, engine.prompt_hashes(prompt)).cached_pages \
                == shared_text
            assert engine.release("probe")
        # the same image again through PD: every full page from decode's cache, same tokens
        again = asyncio.run(pd_run(prefill, decode, prompt, one, "one-again"))
        assert [t for t, _ in again] == [t for t, _ in asyncio.run(run(colocated, prompt, one, "one-ref"))]
        for engine in (colocated, prefill, decode):
            assert engine.stats().used_pages == 0
    finally:
        for engine in (colocated, prefill, decode):
            engine.shutdown()


class _AdmitTogether:
    """The engine's inbox, holding its first `count` new requests until all have arrived and then
    putting them in back to back (one thread, no await between), so its thread takes them in at
    one look (it drains the inbox before each step) and they join the same step."""

    def __init__(self, inbox, count: int) -> None:
        self.inbox, self.count, self.held = inbox, count, []

    def put(self, command) -> None:
        if not isinstance(command, Add) or self.count == 0:
            self.inbox.put(command)
            return
        self.held.append(command)
        if len(self.held) == self.count:
            self.count = 0
            for held in self.held:
                self.inbox.put(held)

    def get(self, *args, **kwargs):
        return self.inbox.get(*args, **kwargs)

    def get_nowait(self):
        return self.inbox.get_nowait()


@contextlib.contextmanager
def admitted_together(engine, count: int):
    inbox = engine.thread.inbox
    engine.thread.inbox = _AdmitTogether(inbox, count)
    try:
        yield
    finally:
        engine.thread.inbox = inbox


def test_decode_recomputes_a_retracted_image_prompt(vl_ckpt, tokenizer, images):
    """Two prefilled requests outgrow the decode engine's 9 pages: one is retracted, and its prompt
    (image tokens included: the vision tower runs on decode then) and output so far are recomputed."""
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True, logprobs=True)
    first, second = [images[0]], [images[1]]
    prompts = [chat_prompt(tokenizer, ["Look at", "IMAGE", "what is it?"], first),
               chat_prompt(tokenizer, ["and", "IMAGE", "this one?"], second)]
    assert all(len(p) + 40 > 4 * PAGE for p in prompts)  # each needs over 4 of the 9 pages at the end
    colocated = start_engine(vl_ckpt, page_size=PAGE, disable_radix_cache=True)
    prefill = start_engine(vl_ckpt, page_size=PAGE, disable_radix_cache=True)
    decode = start_engine(vl_ckpt, page_size=PAGE, num_pages=9, disable_radix_cache=True)
    try:
        expected = [asyncio.run(run(colocated, p, i, f"ref{n}", params)) for n, (p, i) in
                    enumerate(zip(prompts, [first, second], strict=True))]

        async def both():
            # Both prompts' KV lands on decode before either decodes, and decode takes both requests
            # in before its first step, so the two grow in one batch and must outgrow the 9 pages (run
            # one after the other they never would; and a second request that reached the engine some
            # steps after the first, as on a loaded machine, could find the first nearly done).
            cases = [(p, i, f"pd{n}") for n, (p, i) in enumerate(zip(prompts, [first, second], strict=True))]
            firsts = [await pd_prefill(prefill, decode, p, i, room, params) for p, i, room in cases]
            with admitted_together(decode, len(cases)):
                return await asyncio.gather(*(run(decode, p, i, room, params, first_token=f)
                                              for (p, i, room), f in zip(cases, firsts, strict=True)))

        got = asyncio.run(both())
        assert decode.stats().total_retractions > 0
        for g, e in zip(got, expected, strict=True):
            assert [t for t, _ in g] == [t for t, _ in e]
            assert [lp for _, lp in g] == pytest.approx([lp for _, lp in e], abs=1e-4)
        assert decode.stats().used_pages == 0 and prefill.stats().used_pages == 0
    finally:
        for engine in (colocated, prefill, decode):
            engine.shutdown()
