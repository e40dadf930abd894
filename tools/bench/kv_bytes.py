"""`pdserve bench kv-bytes`: KV bytes prefill ships to decode per prompt token, model against model.

    pdserve bench kv-bytes --models tiny-deepseek,tiny

For each model a prefill and a decode worker are started on this machine (the prefix cache off on
both, so every prompt token's KV crosses), `--requests` prompts of `--prompt-len` random tokens are
sent through decode, one new token each, and the prefill worker's
`pdserve:kv_transfer_bytes_total` is read before and after. Bytes per token is that difference over
the prompt tokens sent. The layout's own size per token (all layers) is printed beside it, and
every model's figure as a ratio to the last model's (put the baseline last).

A model is a checkpoint folder or a preset name of `pdserve make-tiny-model` (written to
.cache/models/<preset> if missing). Use a prompt length that is a multiple of the page size:
whole pages move, so a partial last page is shipped whole.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine.models.config import ModelConfig, resolve_dtype
from protos.v1 import worker_pb2, worker_pb2_grpc
from services.common.channels import open_channel
from services.common.security import GrpcSecurity
from tools.bench.serving.prefix_cache import generate_greedy
from tools.launch import NotReady, ProcessGroup, Service
from tools.models.tiny_model import PRESETS

MODELS_DIR = Path(".cache/models")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="tiny-deepseek,tiny",
                        help="comma-separated checkpoint folders or make-tiny-model presets; the last is the "
                             "baseline of the ratios (default tiny-deepseek,tiny: MLA against GQA, hidden "
                             "256 both)")
    parser.add_argument("--transfer-backend", default="mooncake", choices=("mooncake", "nixl", "ucx"))
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)


@dataclass
class Measured:
    model: str
    tokens: int
    bytes_sent: float
    layout_token_bytes: int
    layout: str

    @property
    def per_token(self) -> float:
        return self.bytes_sent / self.tokens


def model_dir(spec: str) -> Path:
    """A checkpoint folder, or a preset written on first use."""
    if spec in PRESETS:
        path = MODELS_DIR / spec
        if not (path / "config.json").is_file():
            subprocess.run([sys.executable, "-m", "pdserve", "make-tiny-model", "--preset", spec,
                            "--out", str(path)], check=True)
        return path
    path = Path(spec)
    if not (path / "config.json").is_file():
        raise SystemExit(f"pdserve bench kv-bytes: {spec!r} is neither a preset "
                         f"({', '.join(sorted(PRESETS))}) nor a checkpoint folder")
    return path


def _worker(group: ProcessGroup, path: Path, mode: str, args: argparse.Namespace) -> Service:
    return group.spawn(mode, [
        "launch-server", "--model-path", str(path), "--disaggregation-mode", mode,
        "--disaggregation-transfer-backend", args.transfer_backend, "--port", "0", "--metrics-port", "0",
        "--dtype", args.dtype, "--page-size", str(args.page_size), "--num-pages", "512", "--num-threads", "1",
        "--disable-radix-cache", "--decode-log-interval", "0"])


async def _send(decode: str, prefill: str, prompts: list[list[int]]) -> None:
    async with open_channel(decode, GrpcSecurity()) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        await stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=60)
        for index, prompt in enumerate(prompts):
            await generate_greedy(stub, prompt, 1, prefill, f"kv-bytes-{index}")


def measure(spec: str, args: argparse.Namespace, log_dir: Path) -> Measured:
    path = model_dir(spec)
    config = ModelConfig.from_dir(path)
    layout = config.kv_layout(args.page_size, resolve_dtype(args.dtype, config))
    rng = random.Random(args.seed)
    vocab = min(config.vocab_size, 4000)
    prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    with ProcessGroup(log_dir / path.name) as group:
        prefill = _worker(group, path, "prefill", args)
        decode = _worker(group, path, "decode", args)
        prefill.wait_ready(300)
        decode.wait_ready(300)
        before = prefill.metric("pdserve:kv_transfer_bytes_total")
        asyncio.run(_send(decode.address, prefill.address, prompts))
        sent = prefill.metric("pdserve:kv_transfer_bytes_total") - before
    return Measured(spec, args.prompt_len * args.requests, sent, layout.token_nbytes, layout.describe())


def main(args: argparse.Namespace) -> int:
    if args.prompt_len <= 0 or args.requests <= 0:
        print("pdserve bench kv-bytes: --prompt-len and --requests must be positive", file=sys.stderr)
        return 2
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-kv-bytes-"))
    try:
        results = [measure(spec, args, log_dir) for spec in args.models.split(",")]
    except NotReady as exc:
        print(f"pdserve bench kv-bytes: a worker did not start: {exc}\nlogs: {log_dir}", file=sys.stderr)
        return 1
    baseline = results[-1]
    print(f"{args.transfer_backend}, {args.dtype}, page size {args.page_size}, "
          f"{args.requests} prompts x {args.prompt_len} tokens, prefix cache off\n")
    print(f"{'model':<16} {'tokens':>7} {'bytes sent':>11} {'bytes/token':>12} {'layout bytes/token':>19} "
          f"{'vs ' + baseline.model:>14}  layout")
    for r in results:
        print(f"{r.model:<16} {r.tokens:>7} {r.bytes_sent:>11.0f} {r.per_token:>12.1f} "
              f"{r.layout_token_bytes:>19} {r.per_token / baseline.per_token:>14.3f}  {r.layout}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
