"""`pdserve bench grpc-messages`: gRPC messages per request, PD against colocated, on one load.

Starts a colocated worker and a prefill + decode pair, then sends the same requests (greedy, fixed
prompts of random token ids, `--max-tokens` tokens each, ignore_eos) to each with `--concurrency`
requests in flight, straight over Worker.Generate as the gateway sends them. Counts, per request,
the messages of the Generate stream (responses) and, for PD, the Prefill call decode makes (one
request, one response). A stream message carries every token that was ready when the worker looked,
so fewer messages than tokens means tokens travelled together.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
from pathlib import Path

import grpc

from protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.generate_response import response_token_ids
from tools.launch import ProcessGroup
from tools.up import ensure_model

PREFILL_CALL_MESSAGES = 2  # decode's Prefill call: one request, one response


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", type=Path, default=Path(".cache/models/tiny"),
                        help="checkpoint (default: built-in tiny)")
    parser.add_argument("--transfer-backend", default="mooncake",
                        help="KV transfer backend (default mooncake)")
    parser.add_argument("--requests", type=int, default=32, help="requests per deployment (default 32)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (default 64)")
    parser.add_argument("--max-tokens", type=int, default=32,
                        help="tokens generated per request (default 32)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")


def prompts(model_path: Path, count: int, length: int) -> list[list[int]]:
    vocab = json.loads((model_path / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


async def stream_messages(address: str, prompt_ids: list[list[int]], max_tokens: int, concurrency: int,
                          prefill_address: str | None, tag: str) -> list[tuple[int, int]]:
    """(stream messages, tokens) of each request."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        sampling = common_pb2.SamplingParams(temperature=0.0, max_new_tokens=max_tokens, ignore_eos=True)
        limit = asyncio.Semaphore(concurrency)

        async def one(index: int) -> tuple[int, int]:
            request = worker_pb2.GenerateRequest(room=f"{tag}-{index}", prompt_token_ids=prompt_ids[index],
                                                 sampling=sampling)
            if prefill_address is not None:
                request.prefill_address = prefill_address
            messages = tokens = 0
            async with limit:
                async for response in stub.Generate(request, timeout=300):
                    messages += 1
                    tokens += len(response_token_ids(response))
            return messages, tokens

        return list(await asyncio.gather(*(one(i) for i in range(len(prompt_ids)))))


def summarize(counts: list[tuple[int, int]], extra_per_request: int) -> dict:
    messages = [m for m, _ in counts]
    return {"stream_messages_per_request": round(statistics.fmean(messages), 2),
            "other_messages_per_request": extra_per_request,
            "messages_per_request": round(statistics.fmean(messages) + extra_per_request, 2),
            "tokens_per_request": round(statistics.fmean(t for _, t in counts), 2)}


def main(args: argparse.Namespace) -> int:
    ensure_model(args.model_path)
    model = str(args.model_path.resolve())
    ids = prompts(args.model_path, args.requests, args.prompt_tokens)
    worker = ["launch-server", "--model-path", model, "--port", "0", "--metrics-port", "0",
              "--num-threads", "1", "--disaggregation-transfer-backend", args.transfer_backend]
    with (tempfile.TemporaryDirectory(prefix="pdserve-grpc-messages-") as tmp,
          ProcessGroup(Path(tmp)) as group):
        colocated, prefill, decode = group.start_many([
            ("colocated", [*worker, "--disaggregation-mode", "null"]),
            ("prefill", [*worker, "--disaggregation-mode", "prefill"]),
            ("decode", [*worker, "--disaggregation-mode", "decode"])])
        asyncio.run(stream_messages(decode.address, ids[:2], args.max_tokens, 2, prefill.address, "warm-pd"))
        asyncio.run(stream_messages(colocated.address, ids[:2], args.max_tokens, 2, None, "warm-colocated"))
        pd = asyncio.run(stream_messages(decode.address, ids, args.max_tokens, args.concurrency,
                                         prefill.address, "pd"))
        co = asyncio.run(stream_messages(colocated.address, ids, args.max_tokens, args.concurrency,
                                         None, "colocated"))
    result = {"requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
              "colocated": summarize(co, 0), "pd": summarize(pd, PREFILL_CALL_MESSAGES)}
    result["pd_over_colocated_stream_messages"] = round(
        result["pd"]["stream_messages_per_request"] / result["colocated"]["stream_messages_per_request"], 3)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0
