"""`pdserve generate`: stream one generation from a local checkpoint, in-process (no services)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid

from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import EngineRequest
from engine.sampling import SamplingParams
from pdserve.config_flags import add_config_arguments, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument("--chat", action="store_true",
                        help="wrap the prompt as one user message with the checkpoint's chat template")
    parser.add_argument("--max-new-tokens", type=int, default=SamplingParams.max_new_tokens)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=SamplingParams.top_p)
    parser.add_argument("--top-k", type=int, default=SamplingParams.top_k)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true")
    add_config_arguments(parser, EngineConfig)


def prompt_ids(tokenizer, prompt: str, chat: bool) -> list[int]:
    if not chat:
        return tokenizer.encode(prompt, add_special_tokens=False)
    encoded = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding here, older versions a plain list.
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


async def _stream(engine: Engine, request: EngineRequest) -> str | None:
    finish = None
    async for batch in engine.generate(request):
        sys.stdout.write("".join(output.text for output in batch))
        sys.stdout.flush()
        finish = batch[-1].finish_reason
    sys.stdout.write("\n")
    return finish


def main(args: argparse.Namespace) -> int:
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos)
    engine = Engine.load(config_from_args(EngineConfig, args))
    engine.start()
    try:
        request = engine.check(EngineRequest(f"cli-{uuid.uuid4().hex[:8]}",
                                             prompt_ids(engine.tokenizer, args.prompt, args.chat), params))
        finish = asyncio.run(_stream(engine, request))
    finally:
        engine.shutdown()
    print(f"[finish: {finish}]", file=sys.stderr)
    return 0
