"""`pdserve bench prefix-cache`: multi-turn chat sharing a system prompt, the prefix cache off and on.

Workload: `--users` users share one system prompt of `--system-len` tokens and talk for `--turns`
turns. Turn t's prompt is the system prompt, then each earlier user message (`--user-len` random
tokens) followed by the model's greedy answer to it (the exact ids it returned, `--output-len`),
then the new user message: every turn extends the conversation. Users run concurrently, each
waiting for its previous answer. Requests go to the worker's gRPC API, as the gateway sends them,
so TTFT is the worker's (request sent to first token back).

Five deployments, each started fresh (cold caches) and alone on the same cores:
  colocated, cache off | colocated, cache on
  pd, cache off        | pd, cache on prefill only (no decode-side reuse) | pd, cache on both
Per run: mean and median TTFT, prompt tokens computed by the worker that runs prompts (prompt
tokens minus its prefix-cache hits), KV bytes prefill transferred and decode saved; then the
on/off ratios. Greedy outputs must be identical across all five (checked). Writes prefix_cache.json.

`--case store`: two prefill workers and one decode, round-robin, with and without the cluster-wide
KV store (Mooncake Store); see prefix_cache_store.py.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from engine.config import EngineConfig
from protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.channels import open_channel
from services.common.generate_response import response_token_ids
from services.common.security import GrpcSecurity
from tools.bench.serving import mooncake_master, report
from tools.bench.serving.deployments import available_cores, split_cores
from tools.launch import NotReady, ProcessGroup, Service

DEFAULT_MODEL = Path(".cache/models/small")


@dataclass(frozen=True)
class Run:
    """One deployment of the comparison."""

    name: str
    pd: bool
    prefill_cache: bool
    decode_cache: bool = False


RUNS = (Run("colocated, cache off", False, False), Run("colocated, cache on", False, True),
        Run("pd, cache off", True, False), Run("pd, prefill cache only", True, True, False),
        Run("pd, cache on (decode reuse)", True, True, True))


@dataclass
class RunResult:
    name: str
    ttft_s: list[float] = field(default_factory=list)
    outputs: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    prompt_tokens: int = 0
    hit_tokens: float = 0.0
    transfer_bytes: float = 0.0
    saved_bytes: float = 0.0
    failures: int = 0

    @property
    def computed_tokens(self) -> float:
        return self.prompt_tokens - self.hit_tokens

    def row(self) -> dict:
        return {"run": self.name, "requests": len(self.ttft_s), "failures": self.failures,
                "ttft_mean_ms": 1000 * statistics.fmean(self.ttft_s) if self.ttft_s else None,
                "ttft_median_ms": 1000 * statistics.median(self.ttft_s) if self.ttft_s else None,
                "prompt_tokens": self.prompt_tokens, "prefill_tokens_computed": self.computed_tokens,
                "kv_transfer_bytes": self.transfer_bytes, "kv_transfer_bytes_saved": self.saved_bytes}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", type=Path, default=DEFAULT_MODEL,
                        help="checkpoint (default .cache/models/small; written with "
                             "`make-tiny-model --preset small` if missing)")
    parser.add_argument("--transfer-backend", default="mooncake", choices=("mooncake", "nixl", "ucx"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-pages", type=int, default=2048, help="KV pages per worker (default 2048)")
    parser.add_argument("--page-size", type=int, default=EngineConfig.page_size)
    parser.add_argument("--chunked-prefill-size", type=int, default=EngineConfig.chunked_prefill_size)
    parser.add_argument("--case", default="cache", choices=("cache", "store"),
                        help="cache: the five runs above (default); store: two prefill workers and one "
                             "decode, round-robin, with and without Mooncake Store "
                             "(tools/bench/serving/prefix_cache_store.py)")
    parser.add_argument("--users", type=int, help="conversations at once (default 4)")
    parser.add_argument("--turns", type=int, help="turns of each conversation (default 4; store case 8)")
    parser.add_argument("--system-len", type=int,
                        help="tokens of the shared system prompt (default 512; store case 128)")
    parser.add_argument("--user-len", type=int,
                        help="tokens of each user message (default 64; store case 16)")
    parser.add_argument("--output-len", type=int, help="tokens of each answer (default 32; store case 128)")
    parser.add_argument("--think-ms", type=float, default=0.0,
                        help="store case: ms between an answer and the user's next turn (default 0)")
    parser.add_argument("--store-segment-mb", type=int, default=128,
                        help="store case: MiB each worker lends to Mooncake Store (default 128; the default "
                             "workload writes about 170 MB in fp32)")
    parser.add_argument("--cores",
                        help="cores to use, e.g. 0-1 or 0,1 (default: every core this process may use)")
    parser.add_argument("--runs", default="1,2,3,4,5",
                        help="which of the five runs to do, by number in the order above (default all; "
                             "cache case only)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--output-dir", type=Path, default=Path("bench-prefix-cache"))
    parser.add_argument("--log-dir", type=Path, help="worker logs (default: a temporary folder)")


def parse_cores(text: str | None) -> list[int]:
    if not text:
        return available_cores()
    cores: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        cores.extend(range(int(low), int(high or low) + 1))
    return cores


class Workload:
    """The conversations: the system prompt and each user's messages, fixed by the seed."""

    def __init__(self, args: argparse.Namespace) -> None:
        rng = random.Random(args.seed)
        tokens = lambda n: [rng.randrange(10, 4000) for _ in range(n)]  # noqa: E731 - ids above the specials
        self.system = tokens(args.system_len)
        self.messages = [[tokens(args.user_len) for _ in range(args.turns)] for _ in range(args.users)]
        self.output_len = args.output_len


async def generate_greedy(stub, prompt: list[int], max_new_tokens: int, prefill: str | None, room: str
                    ) -> tuple[float, list[int]]:
    sampling = common_pb2.SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    request = worker_pb2.GenerateRequest(room=room, prompt_token_ids=prompt, sampling=sampling)
    if prefill:
        request.prefill_address = prefill
    sent = time.perf_counter()
    ttft, tokens = None, []
    async for response in stub.Generate(request, timeout=600):
        ids = response_token_ids(response)
        if ttft is None and ids:
            ttft = time.perf_counter() - sent
        tokens.extend(ids)
    return ttft or 0.0, tokens


async def drive(workload: Workload, address: str, prefill: str | None, result: RunResult) -> None:
    async with open_channel(address, GrpcSecurity()) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        await stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=60)  # the channel is up before timing

        async def user(index: int) -> None:
            history = list(workload.system)
            for turn, message in enumerate(workload.messages[index]):
                prompt = history + message
                try:
                    ttft, answer = await generate_greedy(stub, prompt, workload.output_len, prefill,
                                                         f"u{index}t{turn}")
                except grpc.aio.AioRpcError as exc:
                    print(f"  user {index} turn {turn}: {exc.code().name} {exc.details()}", file=sys.stderr)
                    result.failures += 1
                    return
                result.ttft_s.append(ttft)
                result.prompt_tokens += len(prompt)
                result.outputs[(index, turn)] = answer
                history = prompt + answer

        await asyncio.gather(*(user(i) for i in range(len(workload.messages))))


def _pinned(cores: list[int]) -> tuple[str, ...]:
    return ("taskset", "-c", ",".join(map(str, cores))) if shutil.which("taskset") else ()


def _worker(group: ProcessGroup, args: argparse.Namespace, name: str, mode: str, cores: list[int],
            cache: bool) -> Service:
    flags = ["launch-server", "--model-path", str(args.model_path), "--disaggregation-mode", mode,
             "--disaggregation-transfer-backend", args.transfer_backend, "--port", "0", "--metrics-port", "0",
             "--num-threads", str(len(cores)), "--dtype", args.dtype, "--num-pages", str(args.num_pages),
             "--page-size", str(args.page_size), "--chunked-prefill-size", str(args.chunked_prefill_size),
             "--decode-log-interval", "0"]
    if not cache:
        flags.append("--disable-radix-cache")
    return group.spawn(name, flags, wrapper=_pinned(cores))


async def warm_up(address: str, prefill: str | None, length: int) -> None:
    """One request of unrelated tokens first, so the first measured turn pays no start-up cost."""
    async with open_channel(address, GrpcSecurity()) as channel:
        await generate_greedy(worker_pb2_grpc.WorkerStub(channel), [3] * length, 2, prefill, "warm-up")


def _counters(prompts: Service, decode: Service | None) -> tuple[float, float, float]:
    """(prefix-cache hit tokens where prompts run, KV bytes sent, KV bytes decode saved) so far."""
    hits = prompts.metric("pdserve:prefix_cache_hit_tokens_total")
    if decode is None:
        return hits, 0.0, 0.0
    return (hits, prompts.metric("pdserve:kv_transfer_bytes_total"),
            decode.metric("pdserve:kv_transfer_bytes_saved_total"))


def run_one(run: Run, workload: Workload, args: argparse.Namespace, cores: list[int],
            log_dir: Path) -> RunResult:
    result = RunResult(run.name)
    folder = run.name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "")
    with ProcessGroup(log_dir / folder) as group:
        if run.pd:
            prefill_cores, decode_cores = split_cores(cores)
            prompts = _worker(group, args, "prefill", "prefill", prefill_cores, run.prefill_cache)
            decode = _worker(group, args, "decode", "decode", decode_cores, run.decode_cache)
            prompts.wait_ready(300)
            decode.wait_ready(300)
            target, prefill = decode, prompts.address
        else:
            prompts = _worker(group, args, "colocated", "null", cores, run.prefill_cache).wait_ready(300)
            decode, target, prefill = None, prompts, None
        asyncio.run(warm_up(target.address, prefill, len(workload.system)))
        before = _counters(prompts, decode)
        asyncio.run(drive(workload, target.address, prefill, result))
        after = _counters(prompts, decode)
        result.hit_tokens, result.transfer_bytes, result.saved_bytes = (
            b - a for a, b in zip(before, after, strict=True))
    return result


def _ratio(on: float | None, off: float | None) -> float | None:
    return None if not on or not off else on / off


def ratios(results: dict[str, RunResult]) -> dict[str, float | None]:
    rows = {name: r.row() for name, r in results.items()}
    out: dict[str, float | None] = {}
    for kind, off, on in (("colocated", "colocated, cache off", "colocated, cache on"),
                          ("pd", "pd, cache off", "pd, cache on (decode reuse)")):
        if off in rows and on in rows:
            out[f"{kind} TTFT mean on/off"] = _ratio(rows[on]["ttft_mean_ms"], rows[off]["ttft_mean_ms"])
            out[f"{kind} prefill tokens computed on/off"] = _ratio(rows[on]["prefill_tokens_computed"],
                                                                   rows[off]["prefill_tokens_computed"])
    without, with_reuse = rows.get("pd, prefill cache only"), rows.get("pd, cache on (decode reuse)")
    if without and with_reuse:
        out["pd transfer bytes with/without decode reuse"] = _ratio(with_reuse["kv_transfer_bytes"],
                                                                    without["kv_transfer_bytes"])
    return out


def table(results: dict[str, RunResult], ratio_rows: dict[str, float | None]) -> str:
    lines = [f"{'run':<30} {'TTFT mean ms':>12} {'TTFT p50 ms':>12} {'prefill tok':>12} {'KV MB sent':>11} "
             f"{'KV MB saved':>12}"]
    for result in results.values():
        row = result.row()
        mean = f"{row['ttft_mean_ms']:.1f}" if row["ttft_mean_ms"] is not None else "-"
        median = f"{row['ttft_median_ms']:.1f}" if row["ttft_median_ms"] is not None else "-"
        lines.append(f"{row['run']:<30} {mean:>12} {median:>12} {row['prefill_tokens_computed']:>12.0f} "
                     f"{row['kv_transfer_bytes'] / 1e6:>11.2f} {row['kv_transfer_bytes_saved'] / 1e6:>12.2f}")
    lines.append("")
    for name, value in ratio_rows.items():
        lines.append(f"{name:<48} {'-' if value is None else f'{value:.3f}'}")
    return "\n".join(lines)


CACHE_DEFAULTS = {"users": 4, "turns": 4, "system_len": 512, "user_len": 64, "output_len": 32}


def main(args: argparse.Namespace) -> int:
    from tools.bench.serving import prefix_cache_store  # it imports this module's workload

    defaults = prefix_cache_store.STORE_DEFAULTS if args.case == "store" else CACHE_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if min(args.users, args.turns, args.system_len, args.user_len, args.output_len) <= 0:
        print("pdserve bench prefix-cache: --users, --turns and the lengths must be positive",
              file=sys.stderr)
        return 2
    if not (args.model_path / "config.json").is_file():
        if args.model_path.resolve() != DEFAULT_MODEL.resolve():
            print(f"pdserve bench prefix-cache: --model-path {args.model_path} has no config.json",
                  file=sys.stderr)
            return 2
        subprocess.run([sys.executable, "-m", "pdserve", "make-tiny-model", "--preset", "small",
                        "--out", str(args.model_path)], check=True)
    if args.case == "store":
        if args.store_segment_mb <= 0 or args.think_ms < 0:
            print("pdserve bench prefix-cache: --store-segment-mb must be positive and --think-ms at least 0",
                  file=sys.stderr)
            return 2
        if mooncake_master.binary() is None:  # found out before the run without the store, not after
            print("pdserve bench prefix-cache --case store: mooncake_master not found (it comes with the "
                  "Mooncake wheel, mooncake-transfer-engine)", file=sys.stderr)
            return 2
        return prefix_cache_store.main(args)
    try:
        chosen = [RUNS[int(n) - 1] for n in args.runs.split(",")]
    except (ValueError, IndexError):
        print(f"pdserve bench prefix-cache: --runs {args.runs!r}: numbers from 1 to {len(RUNS)}",
              file=sys.stderr)
        return 2
    cores = parse_cores(args.cores)
    workload = Workload(args)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-prefix-cache-"))
    results: dict[str, RunResult] = {}
    try:
        for run in chosen:
            print(f"### {run.name}", flush=True)
            results[run.name] = run_one(run, workload, args, cores, log_dir)
    except NotReady as exc:
        print(f"pdserve bench prefix-cache: a worker did not start: {exc}\nlogs: {log_dir}", file=sys.stderr)
        return 1
    reference = results[chosen[0].name].outputs
    identical = all(r.outputs == reference for r in results.values())
    ratio_rows = ratios(results)
    print("\n" + table(results, ratio_rows))
    print(f"\ngreedy outputs identical across all runs: {'yes' if identical else 'NO'}")
    for result in results.values():
        differ = sum(1 for key, answer in result.outputs.items() if reference.get(key) != answer)
        if differ:
            print(f"  {result.name}: {differ} of {len(result.outputs)} answers differ from {chosen[0].name!r}"
                  + (" (bf16/fp16 matmuls round differently when a prompt is split at another point; "
                     "compare with --dtype float32)" if args.dtype != "float32" else ""))
    summary = {"model": args.model_path.resolve().name, "dtype": args.dtype, "cores": cores,
               "transfer_backend": args.transfer_backend,
               "workload": {"users": args.users, "turns": args.turns, "system_len": args.system_len,
                            "user_len": args.user_len, "output_len": args.output_len,
                            "page_size": args.page_size},
               "rows": [r.row() for r in results.values()], "ratios": ratio_rows,
               "outputs_identical": identical,
               "outputs": {name: {f"user{u}-turn{t}": ids for (u, t), ids in sorted(r.outputs.items())}
                           for name, r in results.items()},
               "date": time.strftime("%Y-%m-%d %H:%M:%S"),
               "command": " ".join(["pdserve", "bench", "prefix-cache", *sys.argv[3:]])}
    report.write_json(args.output_dir / "prefix_cache.json", summary)
    print(f"wrote {args.output_dir / 'prefix_cache.json'}; logs in {log_dir}")
    failed = any(r.failures for r in results.values())
    # Exactness is a hard requirement in fp32; in bf16/fp16 the outputs are reported, not enforced.
    return 0 if not failed and (identical or args.dtype != "float32") else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
