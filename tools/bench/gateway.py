"""`pdserve bench gateway`: the latency and throughput cost of the gateway over calling a worker.

Starts one colocated worker and a gateway in front of it (child processes), then sends the same
prompts both ways in the same run:
- direct:  Worker.Generate over gRPC with the prompt's token ids (what the gateway itself sends)
- gateway: POST /v1/completions with the prompt text (tokenize, route, relay, JSON)
Latency: requests one at a time, direct and gateway alternating (machine noise hits both alike);
added latency = gateway percentile - direct percentile. Throughput: `--concurrency` requests in
flight, requests/s each way. Greedy, `--max-tokens` tokens (ignore_eos), so the work per request
is identical. Prints JSON with --json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import httpx
import uvloop

from protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.generate_response import response_token_ids
from services.gateway.prompts import ModelFiles
from tools.launch import NotReady, ProcessGroup
from tools.up import ensure_model

DEFAULT_MODEL = Path(".cache/models/tiny")
PROMPTS = [f"Request {i}: the quick brown fox jumps over the lazy dog near the river bank."
           for i in range(16)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", type=Path, default=DEFAULT_MODEL,
                        help="checkpoint (default: built-in tiny)")
    parser.add_argument("--requests", type=int, default=100, help="requests per way and phase (default 100)")
    parser.add_argument("--concurrency", type=int, default=8,
                        help="requests in flight in the throughput phase")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request (default 4)")
    parser.add_argument("--worker-threads", type=int, default=1,
                        help="torch threads of the worker (default 1)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


class Ways:
    """The two ways to run one prompt, as coroutines returning the number of tokens generated."""

    def __init__(self, worker_address: str, gateway_url: str, model: str, files: ModelFiles,
                 max_tokens: int) -> None:
        self.channel = grpc.aio.insecure_channel(worker_address)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.http = httpx.AsyncClient(base_url=gateway_url, timeout=120)
        self.model = model
        self.max_tokens = max_tokens
        self.prompt_ids = [files.encode(text, add_special_tokens=True) for text in PROMPTS]
        self._room = 0

    async def direct(self, index: int) -> int:
        self._room += 1
        sampling = common_pb2.SamplingParams(temperature=0.0, max_new_tokens=self.max_tokens, ignore_eos=True)
        request = worker_pb2.GenerateRequest(room=f"bench-{self._room}",
                                             prompt_token_ids=self.prompt_ids[index % len(PROMPTS)],
                                             sampling=sampling)
        tokens = 0
        async for response in self.stub.Generate(request, timeout=120):
            tokens += len(response_token_ids(response))
        return tokens

    async def gateway(self, index: int) -> int:
        response = await self.http.post("/v1/completions", json={
            "model": self.model, "prompt": PROMPTS[index % len(PROMPTS)], "max_tokens": self.max_tokens,
            "temperature": 0, "ignore_eos": True})
        response.raise_for_status()
        return response.json()["usage"]["completion_tokens"]

    async def close(self) -> None:
        await self.http.aclose()
        await self.channel.close()


async def timed(call: Callable[[int], Awaitable[int]], index: int) -> float:
    started = time.perf_counter()
    tokens = await call(index)
    if tokens <= 0:
        raise RuntimeError("a request generated no tokens")
    return time.perf_counter() - started


async def throughput(call: Callable[[int], Awaitable[int]], requests: int, concurrency: int) -> float:
    next_index = iter(range(requests))

    async def client() -> None:
        for index in next_index:
            await call(index)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return requests / (time.perf_counter() - started)


def summary(samples: list[float]) -> dict[str, float]:
    return {"p50_ms": round(percentile(samples, 50) * 1e3, 3),
            "p99_ms": round(percentile(samples, 99) * 1e3, 3),
            "mean_ms": round(statistics.fmean(samples) * 1e3, 3)}


async def measure(ways: Ways, requests: int, concurrency: int) -> dict:
    for index in range(8):  # warm-up: connections, first-request costs on both sides
        await ways.direct(index)
        await ways.gateway(index)
    direct, gateway = [], []
    for index in range(requests):
        direct.append(await timed(ways.direct, index))
        gateway.append(await timed(ways.gateway, index))
    direct_rps = await throughput(ways.direct, requests, concurrency)
    gateway_rps = await throughput(ways.gateway, requests, concurrency)
    direct_s, gateway_s = summary(direct), summary(gateway)
    return {
        "direct": {**direct_s, "requests_per_s": round(direct_rps, 2)},
        "gateway": {**gateway_s, "requests_per_s": round(gateway_rps, 2)},
        "added_latency_ms": {"p50": round(gateway_s["p50_ms"] - direct_s["p50_ms"], 3),
                             "p99": round(gateway_s["p99_ms"] - direct_s["p99_ms"], 3)},
        "throughput_ratio": round(gateway_rps / direct_rps, 3),
    }


def main(args: argparse.Namespace) -> int:
    ensure_model(args.model_path)
    files = ModelFiles(args.model_path)
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-bench-gateway-"))
    try:
        with ProcessGroup(log_dir) as group:  # stops the gateway, then the worker
            worker = group.start("worker", [
                "launch-server", "--model-path", str(args.model_path), "--disaggregation-mode", "null",
                "--port", "0", "--metrics-port", "0", "--num-threads", str(args.worker_threads)],
                timeout_s=300)
            gateway = group.start("gateway", [
                "launch-router", "--model-path", str(args.model_path), "--port", "0",
                "--policy", "round_robin",
                "--worker", worker.address], timeout_s=120)
            model = args.model_path.resolve().name

            async def run() -> dict:
                # gRPC and httpx clients belong to the loop they are made in
                ways = Ways(worker.address, f"http://{gateway.address}", model, files, args.max_tokens)
                try:
                    return await measure(ways, args.requests, args.concurrency)
                finally:
                    await ways.close()

            result = uvloop.run(run())
    except NotReady as exc:
        print(f"bench gateway: {exc}")
        return 1
    result = {"model": model, "requests": args.requests, "concurrency": args.concurrency,
              "max_tokens": args.max_tokens,
              "prompt_tokens": len(files.encode(PROMPTS[0], add_special_tokens=True)),
              **result}
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))
    return 0
