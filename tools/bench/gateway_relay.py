"""`pdserve bench gateway-relay`: how many streamed tokens per second one gateway process relays on
one core, and what its relay does to the clients' TPOT.

Starts fixed-schedule token sources (tools/bench/token_source.py: gRPC Worker servers that stream a
token per stream every `--tpot-ms`, `--stream-interval` tokens per message, as a worker with that
--stream-interval does) and one gateway (`launch-router --worker ...` on them, its whole HTTP,
routing and relay path; `--processes N` runs it as `--workers N`), then sends `--requests` streamed
chat completions of `--output-len` tokens at `--rate` requests/s (tools/bench/sse_load.py: raw HTTP,
one connection per request). With one process the gateway is pinned to the first CPU and the
sources and clients to the others, so the gateway has one core to itself and what it relays is what
one core can relay. At rate R and output length L the offered load is R x L tokens/s.

It prints, for the load window: the tokens/s the clients received (over the whole run, and while
the load was steady: after the first requests' whole length until the last request started); the
gateway's CPU per token (user + system time of its processes over the tokens received) and the
cores it used, so tokens/s per core = 1 / CPU per token; the clients' TPOT p50 / mean against the sources' own
(--tpot-ms: what TPOT would be with nothing but the schedule in the way) and their ratio; TTFT;
errors; and the CPU the sources and the clients (this process) used, to show what else ran.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import time
from pathlib import Path

import psutil

from tools.bench.cpu_pinning import pin
from tools.bench.measures import cpu_seconds, percentile
from tools.bench.sse_load import StreamTiming, chat_body, run_load
from tools.launch import ProcessGroup, Service
from tools.up import DEFAULT_MODEL, ensure_model

PROMPT = "Summarise the history of the printing press in a few paragraphs for a curious student."
_SOURCE_LINE = re.compile(r"source listening on (\S+)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", type=Path, default=DEFAULT_MODEL,
                        help="tokenizer and chat template to serve (weights are not read; default: tiny)")
    parser.add_argument("--rate", type=float, default=100.0, help="requests started per second")
    parser.add_argument("--requests", type=int, default=1500, help="requests in the measured window")
    parser.add_argument("--output-len", type=int, default=200, help="output tokens per request")
    parser.add_argument("--tpot-ms", type=float, default=10.0, help="the sources' time per output token")
    parser.add_argument("--stream-interval", type=int, default=8, help="tokens per message after the first")
    parser.add_argument("--sources", type=int, default=4, help="token sources (workers to the gateway)")
    parser.add_argument("--processes", type=int, default=1, help="gateway processes on the port (--workers)")
    parser.add_argument("--max-concurrent", type=int, default=1024,
                        help="the gateway's --max-concurrent-requests (it must admit rate x duration)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/pdserve-bench-gateway-relay"), help="logs")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def _source_addresses(source: Service) -> list[str]:
    text = source.log_path.read_text(errors="replace")
    return [source.address, *_SOURCE_LINE.findall(text)]


def run(args: argparse.Namespace) -> dict:
    ensure_model(args.model_path)
    model = str(args.model_path)
    cpus = sorted(os.sched_getaffinity(0))
    pinned = args.processes == 1 and len(cpus) > 1
    with ProcessGroup(args.workdir) as group:
        source = group.start("sources", ["--model-path", model, "--sources", str(args.sources),
                                         "--tpot-ms", str(args.tpot_ms),
                                         "--stream-interval", str(args.stream_interval)],
                             module="tools.bench.token_source")
        addresses = _source_addresses(source)
        while len(addresses) < args.sources:
            time.sleep(0.1)
            addresses = _source_addresses(source)
        worker_flags = [flag for address in addresses for flag in ("--worker", address)]
        gateway = group.start("gateway", ["launch-router", "--model-path", model, "--port", "0",
                                          "--workers", str(args.processes),
                                          "--max-concurrent-requests", str(args.max_concurrent),
                                          *worker_flags], timeout_s=300)
        gateway_proc, source_proc = psutil.Process(gateway.pid), psutil.Process(source.pid)
        me = psutil.Process()
        if pinned:
            pin(gateway_proc, cpus[:1])
            pin(source_proc, cpus[1:])
            os.sched_setaffinity(0, cpus[1:])
        url = f"http://{gateway.address}"
        body = chat_body(args.model_path.name, PROMPT, args.output_len)
        asyncio.run(run_load([url], body, 32, concurrency=32))  # warm-up
        if pinned:  # threads started since (gRPC, the tokenizer pool)
            pin(gateway_proc, cpus[:1])
        cpu0 = {name: cpu_seconds(p) for name, p in (("gateway", gateway_proc), ("sources", source_proc))}
        processes = gateway_proc.children() if args.processes > 1 else [gateway_proc]
        process_cpu0 = [cpu_seconds(p) for p in processes]
        client0 = me.cpu_times()
        began = time.perf_counter()
        timings = asyncio.run(run_load([url], body, args.requests, concurrency=args.requests, rate=args.rate))
        wall = time.perf_counter() - began
        client1 = me.cpu_times()
        used = {name: cpu_seconds(p) - cpu0[name] for name, p in (("gateway", gateway_proc),
                                                                  ("sources", source_proc))}
        per_process = [cpu_seconds(p) - before for p, before in zip(processes, process_cpu0, strict=True)]
    client_cpu = (client1.user + client1.system) - (client0.user + client0.system)
    ok = [t for t in timings if t.error is None]
    tokens = sum(t.tokens for t in ok)
    tpots = [t.tpot for t in ok if t.tpot is not None]
    ttfts = [t.ttft for t in ok if t.ttft is not None]
    ms = 1000.0
    tpot_mean = statistics.fmean(tpots) if tpots else None
    return {
        "setup": {"processes": args.processes, "pinned_to_one_core": pinned, "sources": args.sources,
                  "stream_interval": args.stream_interval, "tpot_ms": args.tpot_ms,
                  "offered_tokens_per_s": round(args.rate * args.output_len)},
        "load": {"requests": len(timings), "errors": len(timings) - len(ok),
                 "first_errors": [t.error for t in timings if t.error][:3], "output_tokens": tokens,
                 "seconds": round(wall, 2), "tokens_per_s": round(tokens / wall),
                 "steady_tokens_per_s": _steady_rate(ok, began, args)},
        "gateway": {"cpu_ms_per_token": round(ms * used["gateway"] / tokens, 4) if tokens else None,
                    "cores_used": round(used["gateway"] / wall, 3),
                    "tokens_per_s_per_core": round(tokens / used["gateway"]) if used["gateway"] else None,
                    "cores_used_per_process": [round(cpu / wall, 3) for cpu in per_process]},
        "client_ms": {"tpot_p50": _ms(percentile(tpots, 0.5)), "tpot_mean": _ms(tpot_mean),
                      "tpot_p99": _ms(percentile(tpots, 0.99)),
                      "tpot_mean_over_sources":
                          round(ms * tpot_mean / args.tpot_ms, 3) if tpot_mean else None,
                      "ttft_p50": _ms(percentile(ttfts, 0.5)), "ttft_p99": _ms(percentile(ttfts, 0.99))},
        "others_cores": {"sources": round(used["sources"] / wall, 3), "clients": round(client_cpu / wall, 3)},
    }


def _steady_rate(timings: list[StreamTiming], began: float, args: argparse.Namespace) -> int | None:
    """Tokens per second received while the load was steady: after the first requests' whole
    length (output_len x tpot) and until the last request started, each stream's tokens counted as
    arriving evenly between its first and last event (the whole run's figure also holds the start,
    when streams are still joining, and the end, when they are leaving)."""
    start = began + args.output_len * args.tpot_ms / 1000.0
    end = began + args.requests / args.rate
    if end <= start:
        return None
    received = 0.0
    for timing in timings:
        if timing.first is None or timing.end is None or timing.end <= timing.first:
            continue
        overlap = max(0.0, min(end, timing.end) - max(start, timing.first))
        received += (timing.tokens - 1) * overlap / (timing.end - timing.first)
        received += 1 if start <= timing.first < end else 0
    return round(received / (end - start))


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def main(args: argparse.Namespace) -> int:
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for section, values in report.items():
            print(f"{section}: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    return 1 if report["load"]["errors"] else 0
