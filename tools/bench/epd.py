"""`pdserve bench epd`: what EPD costs and ships against a colocated worker running the tower itself.

Starts (child processes) a colocated worker of a vision-language model, and an encoder service
(`--encoder-only`) with a `--language-only` worker using it over `--backend`. Then sends the same
one-image chat prompts to both workers directly over gRPC (Worker.Generate, as the gateway sends
them), alternating colocated and EPD, a new image each time (no embedding or prefix cache hit), and
reports:
- TTFT of a one-image request (median and p90), colocated vs EPD, and EPD's with the image
  already in the worker's embedding cache;
- the encoder's images/s (its vision tower's seconds, from its metrics) and the embedding bytes it
  wrote per image.
Default model: the tiny-vl preset written to a temporary folder. Prints JSON with --json.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
from PIL import Image

from protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tools.launch import ProcessGroup


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", type=Path, default=None,
                        help="a Qwen2-VL checkpoint (default: the tiny-vl preset, written to a temporary "
                             "folder)")
    parser.add_argument("--backend", default="mooncake", choices=("mooncake", "nixl"),
                        help="--encoder-transfer-backend (default mooncake)")
    parser.add_argument("--requests", type=int, default=20, help="one-image requests per way (default 20)")
    parser.add_argument("--image-size", type=int, default=224,
                        help="width and height of each image (default 224)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each process (default 1)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")


def png(size: int, seed: int) -> bytes:
    picture = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


def one_image_prompt(model_dir: Path) -> list[int]:
    """A chat turn with one image part (its single image-pad token: the worker expands it)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    content = [{"type": "text", "text": "Describe"}, {"type": "image"},
               {"type": "text", "text": "in detail."}]
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text)["input_ids"]


async def ttft(stub: worker_pb2_grpc.WorkerStub, room: str, prompt: list[int], image: bytes) -> float:
    sampling = common_pb2.SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    started = time.perf_counter()
    first = None
    async for _ in stub.Generate(worker_pb2.GenerateRequest(room=room, prompt_token_ids=prompt,
                                                            sampling=sampling, images=[image]),
                                 timeout=300):
        first = first or time.perf_counter() - started
    return first  # type: ignore[return-value]


async def measure(colocated: str, epd: str, prompt: list[int],
                  args: argparse.Namespace) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"colocated": [], "epd": [], "epd_cached": []}
    async with grpc.aio.insecure_channel(colocated) as c_channel, grpc.aio.insecure_channel(epd) as e_channel:
        ways = {"colocated": worker_pb2_grpc.WorkerStub(c_channel),
                "epd": worker_pb2_grpc.WorkerStub(e_channel)}
        for warmup in range(2):
            for name, stub in ways.items():
                await ttft(stub, f"warm-{name}-{warmup}", prompt, png(args.image_size, 10_000 + warmup))
        for i in range(args.requests):
            image = png(args.image_size, i)  # a new image: no cache anywhere has it
            for name, stub in ways.items():
                times[name].append(await ttft(stub, f"{name}-{i}", prompt, image))
            times["epd_cached"].append(await ttft(ways["epd"], f"epd-again-{i}", prompt, image))
    return times


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"median_ms": statistics.median(ordered) * 1000,
            "p90_ms": ordered[int(0.9 * (len(ordered) - 1))] * 1000}


def main(args: argparse.Namespace) -> int:
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-bench-epd-"))
    model_dir = args.model_path
    if model_dir is None:
        from tools.models.tiny_model import write_tiny_model

        model_dir = write_tiny_model(log_dir / "tiny-vl", preset="tiny-vl", seed=0)
    common = ["--model-path", str(model_dir), "--port", "0", "--metrics-port", "0",
              "--num-threads", str(args.threads)]
    with ProcessGroup(log_dir) as group:
        encoder = group.start("encoder", ["launch-server", *common, "--encoder-only",
                                          "--encoder-transfer-backend", args.backend])
        colocated, language_only = group.start_many([
            ("colocated", ["launch-server", *common, "--num-pages", "512"]),
            ("language-only", ["launch-server", *common, "--num-pages", "512", "--language-only",
                               "--encoder-transfer-backend", args.backend,
                               "--encoder-urls", encoder.address])])
        times = asyncio.run(measure(colocated.address, language_only.address, one_image_prompt(model_dir),
                                    args))
        images = encoder.metric("pdserve:encoder_images_total")
        result = {
            "backend": args.backend, "image_size": args.image_size, "requests": args.requests,
            "ttft": {name: summary(samples) for name, samples in times.items()},
            "encoder_images_per_s": images / encoder.metric("pdserve:encoder_encode_seconds_total"),
            "embedding_bytes_per_image": encoder.metric("pdserve:encoder_embedding_bytes_total") / images,
            "embedding_cache_hits": language_only.metric("pdserve:embedding_cache_hits_total"),
        }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"EPD over {args.backend}, {args.requests} one-image requests of "
              f"{args.image_size}x{args.image_size}:")
        for name, stats in result["ttft"].items():
            print(f"  TTFT {name:<11} median {stats['median_ms']:8.1f} ms   p90 {stats['p90_ms']:8.1f} ms")
        print(f"  encoder: {result['encoder_images_per_s']:.1f} images/s (vision tower), "
              f"{result['embedding_bytes_per_image']:.0f} embedding bytes shipped per image")
    return 0
