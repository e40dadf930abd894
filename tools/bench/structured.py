"""`pdserve bench structured`: what structured outputs cost the engine.

Decode tokens/s at batch B (16) with a JSON schema on every request against the same requests
unconstrained, in alternating rounds on one loaded engine (greedy, eos ignored; the schema is an
unbounded array of small objects, so no request finishes early and every step is masked), and the
compile time of a 50-property schema on the model's tokenizer (cold, then cached). Decode tokens/s
counts the tokens after every request has its first one, as `pdserve bench engine` does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

from tools.bench.engine import make_prompts
from tools.bench.grammar import wide_schema

# Never finishes within the budget: each step of every request is masked.
ENDLESS_SCHEMA = {"type": "object", "properties": {"rows": {"type": "array", "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "n": {"type": "integer", "minimum": 0, "maximum": 999},
                                     "ok": {"type": "boolean"}},
    "required": ["name", "n", "ok"], "additionalProperties": False}}},
    "required": ["rows"], "additionalProperties": False}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF checkpoint folder")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


async def _round(engine, prompts: list[list[int]], params, tag: str) -> float:
    from engine.request import EngineRequest

    stamps: list[list[float]] = [[] for _ in prompts]

    async def one(index: int) -> None:
        request = await engine.prepare(engine.check(EngineRequest(f"{tag}-{index}", prompts[index], params)))
        async for batch in engine.generate(request):
            stamps[index].extend(time.perf_counter() for _ in batch)

    await asyncio.gather(*(one(i) for i in range(len(prompts))))
    all_first = max(s[0] for s in stamps)
    last = max(s[-1] for s in stamps)
    return sum(1 for s in stamps for t in s if t > all_first) / (last - all_first)


def main(args: argparse.Namespace) -> int:
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.sampling import SamplingParams
    from pdserve.sampling_params import StructuredOutput

    torch.set_num_threads(args.threads)
    pages = args.batch * (-(-(args.prompt_len + args.new_tokens) // EngineConfig.page_size) + 1) + 8
    engine = Engine.load(EngineConfig(model_path=args.model, num_threads=args.threads, num_pages=pages,
                                      max_running_requests=args.batch, disable_radix_cache=True))
    engine.start()
    try:
        wide = StructuredOutput("json_schema", json.dumps(wide_schema(50)), strict=True)
        engine.grammars.llg_tokenizer()  # built once per worker; not part of a schema's compile
        began = time.perf_counter()
        engine.grammars.compile(wide)
        cold_ms = (time.perf_counter() - began) * 1e3
        began = time.perf_counter()
        engine.grammars.compile(wide)
        cached_ms = (time.perf_counter() - began) * 1e3

        prompts = make_prompts(args.batch, args.prompt_len, engine.model_config.vocab_size)
        free = SamplingParams(temperature=0, max_new_tokens=args.new_tokens, ignore_eos=True)
        constrained = SamplingParams(temperature=0, max_new_tokens=args.new_tokens, ignore_eos=True,
                                     structured=StructuredOutput("json_schema", json.dumps(ENDLESS_SCHEMA)))
        asyncio.run(_round(engine, prompts, constrained, "warm"))  # compiles and caches the schema
        rates: dict[str, list[float]] = {"none": [], "json_schema": []}
        for r in range(args.repeats):
            rates["none"].append(asyncio.run(_round(engine, prompts, free, f"n{r}")))
            rates["json_schema"].append(asyncio.run(_round(engine, prompts, constrained, f"j{r}")))
        none, schema = statistics.median(rates["none"]), statistics.median(rates["json_schema"])
        result = {"model": args.model, "vocab_size": engine.model_config.vocab_size, "batch": args.batch,
                  "decode_tokens_per_s": {"none": none, "json_schema": schema},
                  "json_schema_over_none": schema / none,
                  "compile_50_properties_ms": {"cold": cold_ms, "cached": cached_ms}}
    finally:
        engine.shutdown()
    if args.json:
        print(json.dumps(result))
    else:
        print(f"vocab {result['vocab_size']}, batch {args.batch}: decode {none:.1f} tok/s unconstrained, "
              f"{schema:.1f} tok/s with a JSON schema on every request ({schema / none:.3f}x)")
        print(f"50-property schema: compile {cold_ms:.1f} ms cold, {cached_ms:.2f} ms cached")
    return 0
