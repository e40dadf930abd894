"""`pdserve bench pd-vs-colocated`: PD against colocated serving on the prefill-interruption workload.

Starts the deployments of deployments.py (colocated, pd, and pd+conditional unless
`--no-conditional`) on the same model and the same cores, all at once, then for each short-request
rate of `--request-rates` runs the prefill-interruption workload (workload.interruption_workload:
short requests arriving at that rate while long prompts arrive at `--long-rate`) against each
deployment in turn, so machine noise hits all of them alike. Every run writes its own JSON and PNG
(bench serving's); the sweep writes pd_vs_colocated.json and pd_vs_colocated.png (goodput, mean and
p99 ITL, TTFT against rate) and prints a table with the PD / colocated ratios.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from engine.config import EngineConfig
from services.worker.config import LocalPrefillRule
from tools.bench.serving import datasets, deployments, metrics, plots, report, runner
from tools.bench.serving.main import benchmark, warmup_prompts
from tools.bench.serving.workload import WorkloadError, interruption_workload
from tools.launch import NotReady, ProcessGroup

DEFAULT_MODEL = Path(".cache/models/small")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", type=Path, default=DEFAULT_MODEL,
                        help="checkpoint (default .cache/models/small; written with "
                             "`make-tiny-model --preset small` if missing)")
    parser.add_argument("--transfer-backend", default="nixl", choices=("mooncake", "nixl", "ucx", "fake"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-pages", type=int, default=2048, help="KV pages per worker (default 2048)")
    parser.add_argument("--chunked-prefill-size", type=int, default=EngineConfig.chunked_prefill_size)
    parser.add_argument("--cores",
                        help="cores to use, e.g. 0-1 or 0,1 (default: every core this process may use)")
    parser.add_argument("--no-conditional", action="store_true", help="skip the pd+conditional deployment")
    parser.add_argument("--local-prefill-max-tokens", type=int, default=LocalPrefillRule.max_tokens,
                        help="pd+conditional: prompts of at most this many tokens run on the decode worker")
    parser.add_argument("--request-rates", default="1,2,4", help="short requests/s to sweep (default 1,2,4)")
    parser.add_argument("--long-rate", type=float, default=0.2, help="long prompts/s (default 0.2)")
    parser.add_argument("--duration", type=float, default=40.0,
                        help="seconds of arrivals per run (default 40)")
    parser.add_argument("--short-input-len", type=int, default=64)
    parser.add_argument("--short-output-len", type=int, default=128)
    parser.add_argument("--long-input-len", type=int, default=2048)
    parser.add_argument("--long-output-len", type=int, default=8)
    parser.add_argument("--slo-ttft-ms", type=float, default=5000.0,
                        help="default 5000 (a long prompt must fit)")
    parser.add_argument("--slo-itl-ms", type=float, default=100.0,
                        help="objective for a request's ITL at --slo-itl-quantile (default 100)")
    parser.add_argument("--slo-itl-quantile", type=float, default=0.99)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--output-dir", type=Path, default=Path("bench-pd-vs-colocated"))
    parser.add_argument("--log-dir", type=Path, help="worker and gateway logs (default: a temporary folder)")
    parser.add_argument("--disable-tqdm", action="store_true")


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise WorkloadError(f"--request-rates {text!r}: expected numbers separated by commas") from None
    if not rates or any(not r > 0 for r in rates):
        raise WorkloadError(f"--request-rates {text!r}: give one or more rates > 0")
    return rates


def parse_cores(text: str | None) -> list[int]:
    if not text:
        return deployments.available_cores()
    cores: list[int] = []
    try:
        for part in text.split(","):
            low, _, high = part.partition("-")
            cores += range(int(low), int(high or low) + 1)
    except ValueError:
        raise WorkloadError(f"--cores {text!r}: expected e.g. 0-1 or 0,1") from None
    allowed = set(deployments.available_cores())
    if not cores or not set(cores) <= allowed:
        raise WorkloadError(f"--cores {text!r}: this process may use cores {sorted(allowed)}")
    return sorted(set(cores))


def wait_healthy(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=3).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise NotReady(f"gateway {url} did not report healthy within {timeout_s:.0f}s")


_ROW_KEYS = ("goodput", "slo_attainment", "request_throughput", "output_throughput", "mean_itl_ms",
             "p99_itl_ms", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "completed", "failed")


def sweep_row(kind: str, rate: float, payload: dict) -> dict:
    row = {"deployment": kind, "rate": rate, **{k: payload.get(k, 0.0) for k in _ROW_KEYS}}
    for name, part in payload["per_class"].items():
        row[name] = {k: part.get(k, 0.0) for k in _ROW_KEYS}
    return row


def ratios(rows: list[dict], kind: str) -> list[dict]:
    """Per rate: `kind` / colocated for goodput, mean and p99 ITL, mean TTFT (below 1: lower)."""
    base = {r["rate"]: r for r in rows if r["deployment"] == "colocated"}
    out = []
    for row in rows:
        ref = base.get(row["rate"])
        if row["deployment"] != kind or ref is None:
            continue
        out.append({"deployment": kind, "rate": row["rate"], **{
            key: (row[key] / ref[key] if ref[key] else None)
            for key in ("goodput", "mean_itl_ms", "p99_itl_ms", "mean_ttft_ms")}})
    return out


def table(rows: list[dict], ratio_rows: list[dict]) -> str:
    head = f"{'deployment':<16}{'rate':>6}{'goodput':>9}{'SLO %':>7}{'mean ITL':>10}{'p99 ITL':>10}" \
           f"{'mean TTFT':>11}{'p99 TTFT':>10}{'failed':>8}"
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: (r["rate"], r["deployment"])):
        lines.append(f"{r['deployment']:<16}{r['rate']:>6g}{r['goodput']:>9.2f}"
                     f"{r['slo_attainment'] * 100:>7.0f}"
                     f"{r['mean_itl_ms']:>10.1f}{r['p99_itl_ms']:>10.1f}{r['mean_ttft_ms']:>11.0f}"
                     f"{r['p99_ttft_ms']:>10.0f}{r['failed']:>8}")
    lines += ["", "ratios to colocated (x; ITL and TTFT: below 1 is lower)",
              f"{'deployment':<16}{'rate':>6}{'goodput':>9}{'mean ITL':>10}{'p99 ITL':>10}{'mean TTFT':>11}"]
    for r in ratio_rows:
        cells = [f"{r[k]:.2f}" if r[k] is not None else "-" for k in ("goodput", "mean_itl_ms", "p99_itl_ms",
                                                                      "mean_ttft_ms")]
        lines.append(f"{r['deployment']:<16}{r['rate']:>6g}{cells[0]:>9}{cells[1]:>10}{cells[2]:>10}{cells[3]:>11}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    try:
        rates = parse_rates(args.request_rates)
        cores = parse_cores(args.cores)
        slo = metrics.Slo(ttft_ms=args.slo_ttft_ms, itl_ms=args.slo_itl_ms,
                          itl_quantile=args.slo_itl_quantile)
        if not args.duration > 0 or not args.long_rate > 0:
            raise WorkloadError("--duration and --long-rate must be > 0")
        if args.long_input_len + args.long_output_len > args.num_pages * EngineConfig.page_size // 2:
            raise WorkloadError("--num-pages is too small for the long prompts")
    except (WorkloadError, ValueError) as exc:
        print(f"pdserve bench pd-vs-colocated: {exc}", file=sys.stderr)
        return 2
    if not (args.model_path / "config.json").is_file():
        if args.model_path.resolve() != DEFAULT_MODEL.resolve():
            print(f"pdserve bench pd-vs-colocated: --model-path {args.model_path} has no config.json",
                  file=sys.stderr)
            return 2
        subprocess.run([sys.executable, "-m", "pdserve", "make-tiny-model", "--preset", "small",
                        "--out", str(args.model_path)], check=True)
    tokenizer = datasets.load_tokenizer(args.model_path)
    settings = deployments.WorkerSettings(model_path=str(args.model_path), backend=args.transfer_backend,
                                          dtype=args.dtype, num_pages=args.num_pages,
                                          chunked_prefill_size=args.chunked_prefill_size,
                                          local_prefill_max_tokens=args.local_prefill_max_tokens)
    kinds = [k for k in deployments.KINDS if not (args.no_conditional and k == "pd+conditional")]
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-pd-vs-colocated-"))
    model = args.model_path.resolve().name
    rows: list[dict] = []
    try:
        with ProcessGroup(log_dir) as group:
            started = {kind: deployments.start(group, kind, settings, cores) for kind in kinds}
            for deployment in started.values():
                wait_healthy(deployment.url)
                print(f"{deployment.kind}: {deployment.url} ({deployment.describe()})")
            for rate in rates:
                classes = interruption_workload(rate, args.long_rate, args.duration,
                                                short_in=args.short_input_len,
                                                short_out=args.short_output_len,
                                                long_in=args.long_input_len, long_out=args.long_output_len)
                rng = random.Random(args.seed)
                batches = [(c, datasets.random_prompts(c, tokenizer, rng)) for c in classes]
                warmup = warmup_prompts([p for _, ps in batches for p in ps], 1, tokenizer, args.seed,
                                        as_text=False)
                for kind, deployment in started.items():
                    run_settings = runner.RunSettings(base_url=deployment.url, model=model,
                                                      max_duration_s=args.duration * 1.5 + 10, drain_s=60.0,
                                                      seed=args.seed, progress=not args.disable_tqdm)
                    tag = f"{kind.replace('+', '-')}-rate{rate:g}"
                    print(f"\n### {kind}, short requests at {rate:g}/s, long prompts at {args.long_rate:g}/s")
                    payload = benchmark(batches, run_settings, slo, output_dir=args.output_dir, tag=tag,
                                        backend=f"pdserve {kind}", request_rate=rate, warmup=warmup,
                                        title=f"{kind} ({deployment.describe()}), short {rate:g}/s + long "
                                              f"{args.long_rate:g}/s, {model} {args.dtype}")
                    rows.append(sweep_row(kind, rate, payload))
    except NotReady as exc:
        print(f"pdserve bench pd-vs-colocated: a service did not start: {exc}\nlogs: {log_dir}",
              file=sys.stderr)
        return 1
    ratio_rows = [r for kind in kinds if kind != "colocated" for r in ratios(rows, kind)]
    print("\n" + table(rows, ratio_rows))
    summary = {"model": model, "dtype": args.dtype, "transfer_backend": args.transfer_backend, "cores": cores,
               "placement": {kind: d.describe() for kind, d in started.items()},
               "workload": {"short": [args.short_input_len, args.short_output_len],
                            "long": [args.long_input_len, args.long_output_len], "long_rate": args.long_rate,
                            "duration_s": args.duration, "request_rates": rates},
               "slo": slo.to_dict(), "rows": rows, "ratios": ratio_rows,
               "date": time.strftime("%Y-%m-%d %H:%M:%S"),
               "command": " ".join(["pdserve", "bench", "pd-vs-colocated", *sys.argv[3:]])}
    report.write_json(args.output_dir / "pd_vs_colocated.json", summary)
    plots.sweep_figure(rows, args.output_dir / "pd_vs_colocated.png",
                       f"PD vs colocated, {model} {args.dtype}, cores {cores}, long prompts "
                       f"{args.long_input_len} tok at {args.long_rate:g}/s, short {args.short_input_len}/"
                       f"{args.short_output_len} tok")
    print(f"wrote {args.output_dir / 'pd_vs_colocated.json'} and {args.output_dir / 'pd_vs_colocated.png'}; "
          f"logs in {log_dir}")
    return 0 if all(r["completed"] for r in rows) else 1

