"""Structured outputs in the engine: masks allow exactly what the grammar allows, the state rebuilt
from tokens equals the state advanced token by token, a constrained request gives the same tokens
colocated, disaggregated and continued after a migration, and bad or slow constraints are refused
with a message without holding up the caller's loop."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import pytest
import torch
from transformers import AutoTokenizer

from engine.grammar import GrammarCompiler, apply_masks, fill_masks
from engine.sampling import SamplingParams
from pdserve.sampling_params import StructuredOutput
from tests.engine.conftest import generate, start_engine
from tests.engine.test_pd_hooks import disaggregated

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "level": {"type": "integer", "minimum": 1, "maximum": 5},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["name", "level", "tags"], "additionalProperties": False}
JSON = StructuredOutput("json_schema", json.dumps(SCHEMA), strict=True)
EOS = 2


@pytest.fixture(scope="module")
def compiler(qwen3_ckpt) -> GrammarCompiler:
    return GrammarCompiler(AutoTokenizer.from_pretrained(qwen3_ckpt), 4096, EOS)


def walk(compiler: GrammarCompiler, structured: StructuredOutput, seed: int, steps: int = 200) -> list[int]:
    """Tokens chosen at random among those each step's mask allows, until eos."""
    grammar = compiler.compile(structured).new_request()
    generator = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(steps):
        grammar.sync(out)
        logits = apply_masks(torch.randn(1, 4096, generator=generator), torch.tensor([0]),
                             fill_masks([grammar], 4096))
        out.append(int(logits.argmax()))
        if out[-1] == EOS:
            break
    return out


def test_masked_random_logits_always_give_valid_output(compiler: GrammarCompiler) -> None:
    tokenizer = compiler._hf_tokenizer
    for seed in range(3):
        out = walk(compiler, JSON, seed)
        assert out[-1] == EOS
        value = json.loads(tokenizer.decode(out[:-1]))
        assert set(value) == {"name", "level", "tags"} and 1 <= value["level"] <= 5
        assert len(value["name"]) <= 8 and set(value["tags"]) <= {"a", "b"}
        assert ",  " not in tokenizer.decode(out[:-1])  # fixed separators: no free whitespace
    for structured, pattern in ((StructuredOutput("regex", "[a-c]{2}x"), "[a-c]{2}x"),
                                (StructuredOutput("choice", ("north", "south")), "north|south"),
                                (StructuredOutput("ebnf", 'root ::= "on" | "off"'), "on|off")):
        assert re.fullmatch(pattern, tokenizer.decode(walk(compiler, structured, 0)[:-1]))


def test_the_state_rebuilt_from_tokens_equals_the_state_advanced_token_by_token(compiler) -> None:
    out = walk(compiler, JSON, seed=1)
    stepped = compiler.compile(JSON).new_request()
    masks = []
    for i in range(len(out)):
        stepped.sync(out[:i])
        masks.append(fill_masks([stepped], 4096))
    for i in (0, 1, len(out) // 2, len(out) - 1):  # a decode side or a continuation joining at token i
        rebuilt = compiler.compile(JSON).new_request()
        rebuilt.sync(out[:i])
        assert torch.equal(fill_masks([rebuilt], 4096), masks[i])


def test_start_after_leaves_the_text_before_it_free(compiler: GrammarCompiler) -> None:
    tokenizer = compiler._hf_tokenizer
    think = tokenizer.encode("</think>", add_special_tokens=False)
    after_thinking = StructuredOutput("choice", ("yes", "no"), start_after="</think>")
    grammar = compiler.compile(after_thinking).new_request()
    assert not grammar.sync([11, 12])  # still thinking: unconstrained
    assert grammar.sync([11, 12, *think])
    allowed = fill_masks([grammar], 4096)
    free = compiler.compile(StructuredOutput("choice", ("yes", "no"))).new_request()
    free.sync([])
    assert torch.equal(allowed, fill_masks([free], 4096))


@pytest.mark.parametrize(("structured", "message"), [
    (StructuredOutput("json_schema", '{"type": "string", "format": "no-such"}', strict=True), "no-such"),
    (StructuredOutput("json_schema", "{not json"), "not valid JSON"),
    (StructuredOutput("regex", "(("), "regex does not compile"),
    (StructuredOutput("ebnf", "root ::= ("), "ebnf grammar does not parse"),
])
def test_bad_constraints_are_refused_naming_the_problem(compiler, structured, message) -> None:
    with pytest.raises(ValueError, match=message):
        compiler.compile(structured)


async def test_a_slow_compile_is_refused_in_time_and_the_loop_keeps_running(compiler, monkeypatch) -> None:
    release = threading.Event()
    real = compiler.compile

    def slow(structured):
        release.wait(10)
        return real(structured)

    monkeypatch.setattr(compiler, "compile", slow)
    monkeypatch.setattr(compiler, "timeout_s", 0.3)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    ticker = asyncio.create_task(tick())
    began = time.monotonic()
    with pytest.raises(ValueError, match="longer than 0.3 s to compile"):
        await compiler.prepare(StructuredOutput("regex", "[0-9]+"))
    ticker.cancel()
    release.set()
    assert time.monotonic() - began < 5 and ticks > 5
    hits = compiler.stats.cache_hits
    await asyncio.sleep(0.2)  # the slow compile finishes in its thread and fills the cache
    monkeypatch.setattr(compiler, "compile", real)
    compiler.compile(StructuredOutput("regex", "[0-9]+"))
    assert compiler.stats.cache_hits == hits + 1


async def test_constrained_greedy_is_the_same_colocated_disaggregated_and_migrated(qwen3_ckpt) -> None:
    prefill = start_engine(qwen3_ckpt, chunked_prefill_size=32, num_pages=128)
    decode = start_engine(qwen3_ckpt, chunked_prefill_size=32, num_pages=128)
    try:
        params = SamplingParams(temperature=0, max_new_tokens=80, structured=JSON,
                                presence_penalty=0.5, frequency_penalty=0.5)
        prompt = list(range(20, 60))
        tokenizer = prefill.tokenizer
        colocated = [o.token_id async for o in generate(prefill, prompt, params, "c")]
        assert colocated[-1] == EOS
        json.loads(tokenizer.decode(colocated[:-1]))
        pd = await disaggregated(prefill, decode, prompt, params, "pd")
        assert [token for token, _, _ in pd] == colocated
        carried = 7
        rest = [o.token_id async for o in generate(
            decode, prompt + colocated[:carried],
            SamplingParams(temperature=0, max_new_tokens=80 - carried, structured=JSON, presence_penalty=0.5,
                           frequency_penalty=0.5), "m", carried_tokens=carried)]
        assert rest == colocated[carried:]
        assert prefill.stats().constrained_steps >= 1 and decode.stats().constrained_steps >= len(colocated)
        # min_tokens cannot hold eos off a grammar that can only end: the grammar wins
        short = SamplingParams(temperature=0.8, seed=3, max_new_tokens=20, min_tokens=15,
                               structured=StructuredOutput("choice", ("yes", "no")))
        outputs = [o async for o in generate(prefill, prompt, short, "short")]
        assert outputs[-1].finish_reason == "stop" and outputs[-1].token_id == EOS
        assert tokenizer.decode([o.token_id for o in outputs[:-1]]) in ("yes", "no")
    finally:
        prefill.shutdown()
        decode.shutdown()
