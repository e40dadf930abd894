"""`pdserve bench prefix-cache --case store`: two prefill workers and one decode worker, no cache
affinity, multi-turn chat, with and without the cluster-wide KV store (Mooncake Store).

The workload is prefix_cache's (a shared system prompt, then each turn appends the model's answer
and a new user message). Each conversation's turns alternate between the two prefill workers (turn
k of user u goes to prefill (u + k) mod 2): round-robin routing as a router without cache affinity
does it, made deterministic so that neither run gets accidental affinity (a global counter with an
even number of users in step would send every user to the same worker each turn). So a turn's
prefill worker never holds the previous turn in its local prefix cache; with the store it fetches
it: the decode worker writes a finished request's full pages (prompt and answer) through to the
store, and the next turn's prefill finds them there.

Two deployments, each fresh (cold caches): prefill x2 + decode with the local prefix cache on,
  1. without the store
  2. with the store (`--enable-hierarchical-cache --hicache-storage-backend mooncake`, on all three
     workers, against a mooncake_master this command starts on a free port and stops after)
Per run: mean and median TTFT, prefill tokens computed (from the prefill workers' /metrics: prompt
tokens looked up minus tokens found in the prefix cache, local or fetched from the store), pages
fetched from the store and written to it; then the ratios with/without (the issue's target:
computed tokens at most 0.3 of without). `--think-ms` waits that long between an answer and the
user's next turn (default 0: at once, so a turn can reach prefill before decode's asynchronous
write of the previous answer has landed in the store; that turn then computes more). Greedy
outputs must be identical across both runs in fp32 (checked). Writes prefix_cache_store.json.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from protos.v1 import worker_pb2, worker_pb2_grpc
from services.common.channels import open_channel
from services.common.security import GrpcSecurity
from tools.bench.serving import report
from tools.bench.serving.deployments import split_cores
from tools.bench.serving.mooncake_master import MasterProcess
from tools.bench.serving.prefix_cache import Workload, _pinned, generate_greedy, parse_cores, warm_up
from tools.launch import NotReady, ProcessGroup, Service

# The store case's workload where the command line leaves it out: enough turns that the
# conversation outgrows the shared system prompt, short user messages against longer answers
# (what a turn adds that no worker has computed yet is the user message; the answer was decoded,
# and decode wrote it to the store).
STORE_DEFAULTS = {"users": 4, "turns": 8, "system_len": 128, "user_len": 16, "output_len": 128}
STORE_WAIT_S = 60.0
WRITES_SETTLE_S = 10.0


@dataclass
class StoreRun:
    name: str
    store: bool
    ttft_s: list[float] = field(default_factory=list)
    outputs: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    prompt_tokens: int = 0
    computed_tokens: float = 0.0
    store_hit_pages: float = 0.0
    store_written_pages: float = 0.0
    store_errors: float = 0.0  # failed or timed-out store calls: a store that is full or away shows here
    failures: int = 0

    def row(self) -> dict:
        return {"run": self.name, "store": self.store, "requests": len(self.ttft_s),
                "failures": self.failures,
                "ttft_mean_ms": 1000 * statistics.fmean(self.ttft_s) if self.ttft_s else None,
                "ttft_median_ms": 1000 * statistics.median(self.ttft_s) if self.ttft_s else None,
                "prompt_tokens": self.prompt_tokens, "prefill_tokens_computed": self.computed_tokens,
                "store_hit_pages": self.store_hit_pages, "store_written_pages": self.store_written_pages,
                "store_errors": self.store_errors}


def prefill_for(user: int, turn: int, prefills: list[str]) -> str:
    return prefills[(user + turn) % len(prefills)]


async def drive(workload: Workload, decode: str, prefills: list[str], result: StoreRun,
                think_s: float) -> None:
    async with open_channel(decode, GrpcSecurity()) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        await stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=60)  # the channel is up before timing

        async def user(index: int) -> None:
            history = list(workload.system)
            for turn, message in enumerate(workload.messages[index]):
                prompt = history + message
                try:
                    ttft, answer = await generate_greedy(stub, prompt, workload.output_len,
                                                         prefill_for(index, turn, prefills),
                                                         f"u{index}t{turn}")
                except grpc.aio.AioRpcError as exc:
                    print(f"  user {index} turn {turn}: {exc.code().name} {exc.details()}", file=sys.stderr)
                    result.failures += 1
                    return
                result.ttft_s.append(ttft)
                result.prompt_tokens += len(prompt)
                result.outputs[(index, turn)] = answer
                history = prompt + answer
                await asyncio.sleep(think_s)  # the user reads and types (--think-ms; default 0)

        await asyncio.gather(*(user(i) for i in range(len(workload.messages))))


def _worker(group: ProcessGroup, args: argparse.Namespace, name: str, mode: str, cores: list[int],
            master: str | None) -> Service:
    flags = ["launch-server", "--model-path", str(args.model_path), "--disaggregation-mode", mode,
             "--disaggregation-transfer-backend", args.transfer_backend, "--port", "0", "--metrics-port", "0",
             "--num-threads", str(len(cores)), "--dtype", args.dtype, "--num-pages", str(args.num_pages),
             "--page-size", str(args.page_size), "--chunked-prefill-size", str(args.chunked_prefill_size),
             "--decode-log-interval", "0"]
    if master:
        flags += ["--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake",
                  "--hicache-mooncake-master", master,
                  "--hicache-mooncake-segment-mb", str(args.store_segment_mb)]
    return group.spawn(name, flags, wrapper=_pinned(cores))


def _wait(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def _totals(prefills: list[Service], decode: Service) -> tuple[float, float, float, float]:
    """(prompt tokens computed by the prefill workers, pages they fetched from the store, pages
    every worker wrote to it, failed store calls) so far."""
    computed = sum(p.metric("pdserve:prefix_cache_query_tokens_total")
                   - p.metric("pdserve:prefix_cache_hit_tokens_total")
                   for p in prefills)
    hits = sum(p.metric("pdserve:hicache_hit_pages_total") for p in prefills)
    written = sum(w.metric("pdserve:hicache_written_pages_total") for w in (*prefills, decode))
    errors = sum(w.metric("pdserve:hicache_store_errors_total") for w in (*prefills, decode))
    return computed, hits, written, errors


def run_one(name: str, master: str | None, workload: Workload, args: argparse.Namespace, cores: list[int],
            log_dir: Path) -> StoreRun:
    result = StoreRun(name, master is not None)
    prefill_cores, decode_cores = split_cores(cores)
    with ProcessGroup(log_dir / ("with-store" if master else "without-store")) as group:
        prefills = [_worker(group, args, f"prefill{i}", "prefill", prefill_cores, master) for i in range(2)]
        decode = _worker(group, args, "decode", "decode", decode_cores, master)
        for worker in (*prefills, decode):
            worker.wait_ready(300)
        workers = (*prefills, decode)
        if master and not _wait(lambda: all(w.metric("pdserve:hicache_store_up") == 1 for w in workers),
                                STORE_WAIT_S):
            raise NotReady(f"the workers did not reach the store at {master} within {STORE_WAIT_S:.0f} s")
        addresses = [p.address for p in prefills]
        for address in addresses:  # each prefill worker's first request pays its start-up cost here
            asyncio.run(warm_up(decode.address, address, len(workload.system)))
        before = _totals(prefills, decode)
        asyncio.run(drive(workload, decode.address, addresses, result, args.think_ms / 1000))
        after = _totals(prefills, decode)
        if master:  # the last turns' writes are asynchronous: count them once they stop growing
            deadline = time.monotonic() + WRITES_SETTLE_S
            while time.monotonic() < deadline:
                time.sleep(0.5)
                now = _totals(prefills, decode)
                if now == after:
                    break
                after = now
        result.computed_tokens, result.store_hit_pages, result.store_written_pages, result.store_errors = (
            b - a for a, b in zip(before, after, strict=True))
    return result


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b


def ratios(without: StoreRun, with_store: StoreRun) -> dict[str, float | None]:
    off, on = without.row(), with_store.row()
    return {"prefill tokens computed with/without store": _ratio(on["prefill_tokens_computed"],
                                                                  off["prefill_tokens_computed"]),
            "TTFT mean with/without store": _ratio(on["ttft_mean_ms"], off["ttft_mean_ms"])}


def table(runs: list[StoreRun], ratio_rows: dict[str, float | None]) -> str:
    lines = [f"{'run':<34} {'TTFT mean ms':>12} {'TTFT p50 ms':>12} {'prompt tok':>11} {'prefill tok':>12} "
             f"{'store hits':>11} {'store writes':>13} {'store errors':>13}"]
    for run in runs:
        row = run.row()
        mean = f"{row['ttft_mean_ms']:.1f}" if row["ttft_mean_ms"] is not None else "-"
        median = f"{row['ttft_median_ms']:.1f}" if row["ttft_median_ms"] is not None else "-"
        lines.append(f"{row['run']:<34} {mean:>12} {median:>12} {row['prompt_tokens']:>11} "
                     f"{row['prefill_tokens_computed']:>12.0f} {row['store_hit_pages']:>11.0f} "
                     f"{row['store_written_pages']:>13.0f} {row['store_errors']:>13.0f}")
    lines.append("")
    for name, value in ratio_rows.items():
        lines.append(f"{name:<48} {'-' if value is None else f'{value:.3f}'}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """The store case (prefix_cache.main has checked the arguments and made the model)."""
    workload = Workload(args)
    cores = parse_cores(args.cores)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-prefix-cache-store-"))
    try:
        print("### 2 prefill + decode, round-robin, without the store", flush=True)
        without = run_one("2 prefill + decode, without store", None, workload, args, cores, log_dir)
        print("### 2 prefill + decode, round-robin, with the store", flush=True)
        with MasterProcess(log_dir / "master") as master:
            with_store = run_one("2 prefill + decode, with store", master.address, workload, args, cores,
                                 log_dir)
    except (NotReady, RuntimeError, FileNotFoundError) as exc:
        print(f"pdserve bench prefix-cache --case store: {exc}\nlogs: {log_dir}", file=sys.stderr)
        return 1
    runs = [without, with_store]
    ratio_rows = ratios(without, with_store)
    identical = with_store.outputs == without.outputs
    print("\n" + table(runs, ratio_rows))
    print(f"\ngreedy outputs identical with and without the store: {'yes' if identical else 'NO'}")
    if not identical:
        differ = sum(1 for key, answer in with_store.outputs.items() if without.outputs.get(key) != answer)
        print(f"  {differ} of {len(with_store.outputs)} answers differ"
              + (" (bf16/fp16 matmuls round differently when a prompt is split at another point; "
                 "compare with --dtype float32)" if args.dtype != "float32" else ""))
    summary = {"case": "store", "model": args.model_path.resolve().name, "dtype": args.dtype, "cores": cores,
               "transfer_backend": args.transfer_backend,
               "workload": {"users": args.users, "turns": args.turns, "system_len": args.system_len,
                            "user_len": args.user_len, "output_len": args.output_len,
                            "page_size": args.page_size, "think_ms": args.think_ms},
               "rows": [r.row() for r in runs], "ratios": ratio_rows, "outputs_identical": identical,
               "date": time.strftime("%Y-%m-%d %H:%M:%S"),
               "command": " ".join(["pdserve", "bench", "prefix-cache", *sys.argv[3:]])}
    report.write_json(args.output_dir / "prefix_cache_store.json", summary)
    print(f"wrote {args.output_dir / 'prefix_cache_store.json'}; logs in {log_dir}")
    failed = without.failures or with_store.failures
    return 0 if not failed and (identical or args.dtype != "float32") else 1
