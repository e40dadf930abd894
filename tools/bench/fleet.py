"""`pdserve bench fleet`: simulated prefill and decode workers (`launch-server --engine sim`), a
registry and gateways, loaded with streamed chats at a target request rate.

Starts a registry, `--prefill` + `--decode` simulated workers (each its own process, one torch
thread, real KV transfer of small pages over `--transfer-backend`), and `--gateways` gateways that
find them through the registry, then sends `--requests` streamed chat completions (`--output-len`
tokens each, ignore_eos) at `--rate` requests/s round-robin over the gateways (tools/bench/sse_load.py).
It prints, for the load window:

- gateway CPU per relayed token (user + system time of every gateway process over the tokens the
  clients received) and the cores the gateways used;
- the routing decision p50 / p99, from the gateways' `gateway_routing_decision_seconds` histograms;
- the registry's CPU share (its process's CPU seconds over the window);
- client TTFT and TPOT (p50 / p99), against the timing model's own TPOT: the profile's step time at
  the mean decode batch the decode workers ran (their step counters), which is what TPOT would be
  with nothing but the model's steps in the way;
- KV-event lag p50 / p99, from the gateways' `gateway_kv_event_lag_seconds` histograms (the
  workers' stamp of each batch's oldest event to the gateway applying it).

- the workers' costs: private memory (USS) per worker, mean and max, and the PSS of all of them
  (shared pages split among their sharers), so the fleet's memory reads off directly; and the cores
  all workers used idle (5 s after the warm-up, before the load) and under the load, the decode
  workers' share of the latter, and their CPU per output token.

Workers are forked from one fork server that imported them (tools/worker_forks.py), so they share
one import of torch and the rest: about 30 MB private each instead of about 290 MB started alone
(`--no-fork-workers` starts each as its own `pdserve launch-server` process). What this machine can
run bounds the scale: the workers' engine threads, gRPC and transfers cost CPU, so on a 2-core
machine the workers' own CPU, not the modeled GPU time, caps the rate long before 32 pairs at 4,500
tok/s each; the output says how busy the machine was.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from contextlib import nullcontext
from pathlib import Path

import httpx
import psutil

from engine.sim.profile import SimProfile
from tools.bench.measures import cpu_seconds, percentile
from tools.bench.sse_load import StreamTiming, chat_body, run_load
from tools.launch import ProcessGroup, Service
from tools.metrics import scrape
from tools.up import DEFAULT_MODEL, ensure_model
from tools.worker_forks import ForkServer

IDLE_WINDOW_S = 5.0  # how long the workers' idle CPU is measured, after the warm-up
PROMPT = "Summarise the history of the printing press in a few paragraphs for a curious student."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", type=Path, default=DEFAULT_MODEL,
                        help="config.json and tokenizer to simulate (weights are not read; default: tiny)")
    parser.add_argument("--prefill", type=int, default=2, help="simulated prefill workers")
    parser.add_argument("--decode", type=int, default=2, help="simulated decode workers")
    parser.add_argument("--gateways", type=int, default=1, help="gateways (each its own process)")
    parser.add_argument("--rate", type=float, default=8.0, help="requests started per second")
    parser.add_argument("--requests", type=int, default=120, help="requests in the measured window")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    parser.add_argument("--stream-interval", type=int, default=1, help="the workers' --stream-interval")
    parser.add_argument("--baseline-stream-interval", type=int, default=None,
                        help="first run the whole bench with this --stream-interval (e.g. 1) as the "
                             "baseline, then with --stream-interval, and print both and their ratio")
    parser.add_argument("--transfer-backend", default="mooncake", help="KV transfer backend of the workers")
    parser.add_argument("--sim-profile", default=None, help="the workers' --sim-profile (default: built-in)")
    parser.add_argument("--fork-workers", action=argparse.BooleanOptionalAction, default=True,
                        help="fork the workers from one process that imported them, sharing its pages "
                             "(default); --no-fork-workers starts each as its own process")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/pdserve-bench-fleet"), help="logs")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def _histogram_quantile(samples: dict[str, float], name: str, q: float) -> float | None:
    """The q-quantile of a Prometheus histogram summed over `samples` (linear within a bucket)."""
    buckets: dict[float, float] = {}
    for key, value in samples.items():
        if key.startswith(name + "_bucket{"):
            bound = key.split('le="', 1)[1].split('"', 1)[0]
            edge = float("inf") if bound == "+Inf" else float(bound)
            buckets[edge] = buckets.get(edge, 0.0) + value
    if not buckets or buckets.get(float("inf"), 0.0) == 0:
        return None
    total = buckets[float("inf")]
    previous_edge, previous_count = 0.0, 0.0
    for edge in sorted(buckets):
        count = buckets[edge]
        if count >= q * total:
            if edge == float("inf"):
                return previous_edge
            share = (q * total - previous_count) / max(count - previous_count, 1e-12)
            return previous_edge + (edge - previous_edge) * share
        previous_edge, previous_count = edge, count
    return previous_edge


def _merged(services: list[Service]) -> dict[str, float]:
    merged: dict[str, float] = {}
    for service in services:
        for key, value in scrape(f"http://{service.address}/metrics", 10.0).items():
            merged[key] = merged.get(key, 0.0) + value
    return merged


def _decode_rows(decodes: list[Service]) -> tuple[float, float]:
    """(decode rows, steps with decode rows) summed over the decode workers, so far."""
    rows = sum(d.metric("pdserve:engine_decode_tokens_total") for d in decodes)
    steps = sum(d.metric("pdserve:engine_steps_total", kind=kind)
                for d in decodes for kind in ("decode", "mixed"))
    return rows, steps


def _wait_for_workers(gateways: list[Service], prefill: int, decode: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        views = []
        for gateway in gateways:
            try:
                answer = httpx.get(f"http://{gateway.address}/health", timeout=5).json()
                views.append(answer.get("workers", {}))
            except (httpx.HTTPError, ValueError):
                views.append({})
        if all(v.get("prefill") == prefill and v.get("decode") == decode for v in views):
            return
        time.sleep(0.5)
    raise SystemExit(f"bench fleet: the gateways did not see {prefill} prefill + {decode} decode workers "
                     f"within {timeout_s:.0f}s")


def run(args: argparse.Namespace) -> dict:
    ensure_model(args.model_path)
    model = str(args.model_path)
    worker_extra = ["--engine", "sim", "--stream-interval", str(args.stream_interval),
                    "--num-threads", "1", "--disaggregation-transfer-backend", args.transfer_backend,
                    "--decode-log-interval", "0"]
    if args.sim_profile:
        worker_extra += ["--sim-profile", args.sim_profile]
    forks = ForkServer(args.workdir, model) if args.fork_workers else nullcontext()
    # The group is left first: its workers stop gracefully before the fork server goes.
    with forks, ProcessGroup(args.workdir) as group:
        bootstrap = group.start("bootstrap", ["bootstrap", "--port", "0", "--metrics-port", "0"])
        specs = [(f"{role}{i}", ["launch-server", "--model-path", model, "--disaggregation-mode", role,
                                  "--port", "0", "--metrics-port", "0", "--bootstrap", bootstrap.address,
                                  *worker_extra])
                 for role, count in (("prefill", args.prefill), ("decode", args.decode))
                 for i in range(count)]
        if isinstance(forks, ForkServer):
            spawned = [forks.spawn(name, spec, args.workdir / f"{name}.log") for name, spec in specs]
            group.procs += spawned
            workers = [worker.wait_ready(600) for worker in spawned]
        else:
            workers = group.start_many(specs, 600)
        decodes = [w for w in workers if w.name.startswith("decode")]
        gateways = group.start_many([(f"gateway{i}", ["launch-router", "--model-path", model, "--port", "0",
                                                      "--bootstrap", bootstrap.address])
                                     for i in range(args.gateways)], 300)
        _wait_for_workers(gateways, args.prefill, args.decode)
        urls = [f"http://{g.address}" for g in gateways]
        body = chat_body(args.model_path.name, PROMPT, args.output_len)
        asyncio.run(run_load(urls, body, 2 * len(decodes), concurrency=2 * len(decodes)))  # warm-up

        gateway_procs = [psutil.Process(g.pid) for g in gateways]
        registry_proc = psutil.Process(bootstrap.pid)
        worker_procs = [psutil.Process(w.pid) for w in workers]
        idle_cpu0 = sum(cpu_seconds(p) for p in worker_procs)
        time.sleep(IDLE_WINDOW_S)  # what the workers cost doing nothing: heartbeats, idle loops
        idle_cores = (sum(cpu_seconds(p) for p in worker_procs) - idle_cpu0) / IDLE_WINDOW_S
        before_routing = _merged(gateways)
        rows0, steps0 = _decode_rows(decodes)
        gateway_cpu0 = sum(cpu_seconds(p) for p in gateway_procs)
        registry_cpu0 = cpu_seconds(registry_proc)
        decode_procs = [psutil.Process(w.pid) for w in decodes]
        worker_cpu0 = sum(cpu_seconds(p) for p in worker_procs)
        decode_cpu0 = sum(cpu_seconds(p) for p in decode_procs)
        psutil.cpu_percent()
        began = time.perf_counter()
        timings = asyncio.run(run_load(urls, body, args.requests, concurrency=args.requests, rate=args.rate))
        wall = time.perf_counter() - began
        machine_busy = psutil.cpu_percent()
        gateway_cpu = sum(cpu_seconds(p) for p in gateway_procs) - gateway_cpu0
        registry_cpu = cpu_seconds(registry_proc) - registry_cpu0
        worker_cpu = sum(cpu_seconds(p) for p in worker_procs) - worker_cpu0
        decode_cpu = sum(cpu_seconds(p) for p in decode_procs) - decode_cpu0
        rows1, steps1 = _decode_rows(decodes)
        after_routing = _merged(gateways)
        costs = {**_worker_memory(workers), "idle_cores": round(idle_cores, 3),
                 "load_cores": round(worker_cpu / wall, 3), "decode_share": round(decode_cpu / worker_cpu, 3)
                 if worker_cpu else None}
    routing = {k: after_routing[k] - before_routing.get(k, 0.0) for k in after_routing}
    return _figures(args, timings, wall, gateway_cpu, registry_cpu, routing, rows1 - rows0,
                    steps1 - steps0, machine_busy, costs)


def _worker_memory(workers: list[Service]) -> dict:
    """The workers' private memory (USS) per worker and their PSS summed, in MiB."""
    infos = []
    for worker in workers:
        try:
            infos.append(psutil.Process(worker.pid).memory_full_info())
        except psutil.Error:
            continue
    if not infos:
        return {}
    mib = 1 << 20
    private = [info.uss / mib for info in infos]
    return {"uss_mean_mib": round(statistics.fmean(private), 1), "uss_max_mib": round(max(private), 1),
            "pss_total_mib": round(sum(info.pss for info in infos) / mib)}


def _figures(args: argparse.Namespace, timings: list[StreamTiming], wall: float, gateway_cpu: float,
             registry_cpu: float, routing: dict[str, float], rows: float, steps: float,
             machine_busy: float, worker_costs: dict) -> dict:
    ok = [t for t in timings if t.error is None]
    tokens = sum(t.tokens for t in ok)
    ttfts = [t.ttft for t in ok if t.ttft is not None]
    tpots = [t.tpot for t in ok if t.tpot is not None]
    mean_batch = rows / steps if steps else 0.0
    profile = SimProfile.load(args.sim_profile)
    modeled_tpot = profile.step_seconds(max(1, round(mean_batch)), 0)
    decision = "pdserve:gateway_routing_decision_seconds"
    lag = "pdserve:gateway_kv_event_lag_seconds"
    ms = 1000.0
    return {
        "workers": {"prefill": args.prefill, "decode": args.decode, "gateways": args.gateways,
                    "stream_interval": args.stream_interval, "transfer_backend": args.transfer_backend},
        "load": {"rate_rps": args.rate, "requests": len(timings), "errors": len(timings) - len(ok),
                 "first_errors": [t.error for t in timings if t.error][:3], "output_tokens": tokens,
                 "seconds": round(wall, 2), "tokens_per_s": round(tokens / wall, 1),
                 "machine_cpu_percent": machine_busy},
        "gateway": {"cpu_ms_per_token": round(ms * gateway_cpu / tokens, 4) if tokens else None,
                    "cores_used": round(gateway_cpu / wall, 3),
                    "tokens_per_s_per_core": round(tokens / gateway_cpu) if gateway_cpu else None},
        "routing_decision_ms": {
            "p50": _scaled(_histogram_quantile(routing, decision, 0.5), ms),
            "p99": _scaled(_histogram_quantile(routing, decision, 0.99), ms),
            "count": routing.get(decision + "_count", 0.0)},
        "worker_costs": {**worker_costs, "forked": args.fork_workers,
                         "cpu_ms_per_token": round(ms * worker_costs["load_cores"] * wall / tokens, 4)
                         if tokens else None},
        "registry": {"cpu_percent": round(100 * registry_cpu / wall, 2)},
        "kv_event_lag_ms": {"p50": _scaled(_histogram_quantile(routing, lag, 0.5), ms),
                            "p99": _scaled(_histogram_quantile(routing, lag, 0.99), ms),
                            "batches": routing.get(lag + "_count", 0.0)},
        "client_ms": {"ttft_p50": _scaled(percentile(ttfts, 0.5), ms),
                      "ttft_p99": _scaled(percentile(ttfts, 0.99), ms),
                      "tpot_p50": _scaled(percentile(tpots, 0.5), ms),
                      "tpot_p99": _scaled(percentile(tpots, 0.99), ms),
                      "tpot_mean": _scaled(statistics.fmean(tpots) if tpots else None, ms)},
        "timing_model": {"mean_decode_batch": round(mean_batch, 2),
                         "tpot_ms": round(ms * modeled_tpot, 3)},
    }


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else round(value * factor, 4)


def main(args: argparse.Namespace) -> int:
    runs = {}
    if args.baseline_stream_interval is not None:
        runs["baseline"] = run(argparse.Namespace(**{**vars(args),
                                                     "stream_interval": args.baseline_stream_interval}))
    runs["measured"] = run(args)
    report: dict = dict(runs)
    if "baseline" in runs:
        base, new = (runs[k]["gateway"]["cpu_ms_per_token"] for k in ("baseline", "measured"))
        ratio = round(new / base, 3) if base and new else None
        report["gateway_cpu_per_token_measured_over_baseline"] = ratio
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for name, figures in runs.items():
            print(f"== {name}")
            for section, values in figures.items():
                print(f"{section}: " + ", ".join(f"{k}={v}" for k, v in values.items()))
        if "baseline" in runs:
            print("gateway CPU per token, measured / baseline:",
                  report["gateway_cpu_per_token_measured_over_baseline"])
    return 0 if all(r["load"]["errors"] == 0 for r in runs.values()) else 1
