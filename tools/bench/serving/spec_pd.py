"""`pdserve bench serving-spec`: PD serving with speculative decoding on and off, side by side.

Starts one 1 prefill + 1 decode deployment per system (deployments.py's `pd`: prefill on the first
half of the cores, decode on the rest, KV over a real transfer engine, each behind its own gateway):
`off` (no speculative flags) and one per `--spec NAME=FLAGS`, whose FLAGS go to both workers (they
must agree on the draft config: the handshake refuses a pair that differs). Every system serves the
same checkpoint, so greedy answers are the same and only their speed differs. For each concurrency of
`--concurrencies` it runs the same closed-loop load (`pdserve bench serving`'s client: random token-id
prompts of `--input-len`, `--output-len` generated with ignore_eos, greedy) against each system in
turn, the order alternating between concurrencies so machine noise hits all alike, and prints TPOT
and ITL (mean, p50, p99) and output tokens/s with each system's ratio to `off`, plus the decode
worker's drafted and accepted tokens over the run (its /metrics).

A workload whose answers copy their prompts (NGRAM's case) needs a model that copies: with
tools/models/copying_model.py's checkpoint every answer repeats its prompt's last tokens:

    python -m tools.models.copying_model --model .cache/models/small --out .cache/models/small-copying
    pdserve bench serving-spec --model-path .cache/models/small-copying --concurrencies 1,8
    pdserve bench serving-spec --model-path .cache/models/small-agreeing1 \\
        --spec ngram="--speculative-algorithm NGRAM" \\
        --spec standalone="--speculative-algorithm STANDALONE \\
            --speculative-draft-model-path .cache/models/small-agreeing1-draft"
"""

from __future__ import annotations

import argparse
import random
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tools.bench.serving import datasets, deployments, metrics, report, runner
from tools.bench.serving.main import benchmark, warmup_prompts
from tools.bench.serving.pd_vs_colocated import DEFAULT_MODEL, parse_cores, wait_healthy
from tools.bench.serving.workload import RequestClass, WorkloadError
from tools.launch import NotReady, ProcessGroup
from tools.metrics import sum_samples

BASELINE = "off"
DEFAULT_SPEC = "ngram=--speculative-algorithm NGRAM"
# (JSON key, column head): the figures compared, each with its ratio to the baseline.
FIGURES = (("output_throughput", "out tok/s"),
           ("mean_tpot_ms", "TPOT mean"), ("median_tpot_ms", "TPOT p50"), ("p99_tpot_ms", "TPOT p99"),
           ("mean_itl_ms", "ITL mean"), ("median_itl_ms", "ITL p50"), ("p99_itl_ms", "ITL p99"))
_SPEC_COUNTERS = ("pdserve:spec_drafted_tokens_total", "pdserve:spec_accepted_tokens_total",
                  "pdserve:spec_verify_rows_total")


@dataclass(frozen=True)
class System:
    """One deployment to compare: a name and the flags every worker of it gets."""

    name: str
    worker_flags: tuple[str, ...]


def parse_system(text: str) -> System:
    """`NAME=FLAGS` (FLAGS split as a shell would) into a System; a clear error naming the flag."""
    name, sep, flags = text.partition("=")
    name = name.strip()
    if not sep or not name or not name.replace("-", "").replace("_", "").isalnum():
        raise WorkloadError(f"--spec {text!r}: expected NAME=FLAGS, "
                            "e.g. ngram='--speculative-algorithm NGRAM'")
    if name == BASELINE:
        raise WorkloadError(f"--spec {text!r}: {BASELINE!r} is the name of the baseline without speculation")
    try:
        split = tuple(shlex.split(flags))
    except ValueError as exc:
        raise WorkloadError(f"--spec {text!r}: {exc}") from None
    if not split:
        raise WorkloadError(f"--spec {text!r}: no flags after '='")
    return System(name, split)


def parse_systems(specs: list[str] | None) -> list[System]:
    """The baseline (no speculative flags) first, then one System per --spec (NGRAM when none given)."""
    systems = [System(BASELINE, ()), *(parse_system(s) for s in (specs or [DEFAULT_SPEC]))]
    names = [s.name for s in systems]
    if len(set(names)) != len(names):
        raise WorkloadError(f"--spec: names must differ, got {names}")
    return systems


def parse_concurrencies(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise WorkloadError(f"--concurrencies {text!r}: expected integers separated by commas") from None
    if not values or any(v < 1 for v in values):
        raise WorkloadError(f"--concurrencies {text!r}: give one or more values >= 1")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", type=Path, default=DEFAULT_MODEL,
                        help="checkpoint every system serves (default .cache/models/small)")
    parser.add_argument("--spec", action="append", metavar="NAME=FLAGS",
                        help="a system with speculation: its name and the flags both its workers get, e.g. "
                             "ngram='--speculative-algorithm NGRAM' (repeatable; default: "
                             f"{DEFAULT_SPEC!r}); the baseline {BASELINE!r} is always run")
    parser.add_argument("--concurrencies", default="1,8", help="closed-loop clients per run (default 1,8)")
    parser.add_argument("--requests-per-client", type=int, default=3,
                        help="measured requests per run = this x the concurrency (default 3)")
    parser.add_argument("--input-len", type=int, default=128, help="random prompt tokens (default 128)")
    parser.add_argument("--output-len", type=int, default=64,
                        help="tokens generated, ignore_eos (default 64)")
    parser.add_argument("--transfer-backend", default="nixl", choices=("mooncake", "nixl", "ucx"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-pages", type=int, default=1024, help="KV pages per worker (default 1024)")
    parser.add_argument("--cores", help="cores to use, e.g. 0-1 (default: every core this process may use)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--output-dir", type=Path, default=Path("bench-serving-spec"))
    parser.add_argument("--log-dir", type=Path, help="worker and gateway logs (default: a temporary folder)")
    parser.add_argument("--disable-tqdm", action="store_true")


def spec_counters(deployment: deployments.Deployment) -> dict[str, float]:
    samples = deployment.workers["decode"].metrics()
    return {name: sum_samples(samples, name) or 0.0 for name in _SPEC_COUNTERS}


def row_of(system: str, concurrency: int, payload: dict, drafted: dict[str, float], run: int = 0) -> dict:
    """`run`: the index in --concurrencies (a concurrency may be given twice, to see the noise)."""
    verifies = drafted["pdserve:spec_verify_rows_total"]
    accepted = drafted["pdserve:spec_accepted_tokens_total"]
    return {"system": system, "run": run, "concurrency": concurrency, "completed": payload["completed"],
            "failed": payload["failed"], **{key: payload.get(key, 0.0) for key, _ in FIGURES},
            "drafted_tokens": int(drafted["pdserve:spec_drafted_tokens_total"]),
            "accepted_tokens": int(accepted),
            "accept_len": 1 + accepted / verifies if verifies else None}


def ratio_rows(rows: list[dict]) -> list[dict]:
    """Each system's figures over the baseline's in the same run (None where the baseline's is 0)."""
    base = {r["run"]: r for r in rows if r["system"] == BASELINE}
    out = []
    for row in rows:
        ref = base.get(row["run"])
        if row["system"] == BASELINE or ref is None:
            continue
        out.append({"system": row["system"], "run": row["run"], "concurrency": row["concurrency"],
                    **{key: row[key] / ref[key] if ref[key] else None for key, _ in FIGURES}})
    return out


def table(rows: list[dict], ratios: list[dict]) -> str:
    """Markdown: the figures per system and concurrency, then the on / off ratios."""
    heads = [head for _, head in FIGURES]
    lines = ["| system | conc. | " + " | ".join(heads) + " | drafted | accepted | accept len |",
             "|---|---|" + "---|" * (len(heads) + 3)]
    for r in sorted(rows, key=lambda r: (r["run"], r["system"] != BASELINE, r["system"])):
        cells = [f"{r[key]:.1f}" for key, _ in FIGURES]
        accept = f"{r['accept_len']:.2f}" if r["accept_len"] else "-"
        lines.append(f"| {r['system']} | {r['concurrency']} | " + " | ".join(cells)
                     + f" | {r['drafted_tokens']} | {r['accepted_tokens']} | {accept} |")
    lines += ["", f"ratios to {BASELINE!r} (x; out tok/s: above 1 is faster; TPOT and ITL: below 1 is "
              "faster)",
              "", "| system | conc. | " + " | ".join(heads) + " |", "|---|---|" + "---|" * len(heads)]
    for r in ratios:
        cells = [f"{r[key]:.2f}" if r[key] is not None else "-" for key, _ in FIGURES]
        lines.append(f"| {r['system']} | {r['concurrency']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _check(args: argparse.Namespace) -> tuple[list[System], list[int], list[int]]:
    systems = parse_systems(args.spec)
    concurrencies = parse_concurrencies(args.concurrencies)
    for flag, value in (("--requests-per-client", args.requests_per_client), ("--input-len", args.input_len),
                        ("--output-len", args.output_len)):
        if value < 1:
            raise WorkloadError(f"{flag} must be >= 1, got {value}")
    if not (args.model_path / "config.json").is_file():
        raise WorkloadError(f"--model-path {args.model_path}: no config.json there")
    return systems, concurrencies, parse_cores(args.cores)


def run_one(system: System, deployment: deployments.Deployment, concurrency: int,
            batch: tuple[RequestClass, list[datasets.Prompt]], warmup: list[datasets.Prompt],
            args: argparse.Namespace, run: int) -> dict:
    """One measured closed-loop run against `deployment`; its row (figures and the run's drafts)."""
    print(f"\n### {system.name} ({' '.join(system.worker_flags) or 'no speculation'}), "
          f"concurrency {concurrency}")
    settings = runner.RunSettings(base_url=deployment.url, model=args.model_path.resolve().name,
                                  max_concurrency=concurrency, max_duration_s=900.0, drain_s=120.0,
                                  seed=args.seed, progress=not args.disable_tqdm)
    before = spec_counters(deployment)
    payload = benchmark([batch], settings, metrics.Slo(), output_dir=args.output_dir,
                        tag=f"{system.name}-run{run}-c{concurrency}", backend=f"pdserve pd {system.name}",
                        request_rate=float("inf"), warmup=warmup)
    after = spec_counters(deployment)
    return row_of(system.name, concurrency, payload, {k: after[k] - before[k] for k in _SPEC_COUNTERS}, run)


def main(args: argparse.Namespace) -> int:
    try:
        systems, concurrencies, cores = _check(args)
    except (WorkloadError, ValueError) as exc:
        print(f"pdserve bench serving-spec: {exc}", file=sys.stderr)
        return 2
    tokenizer = datasets.load_tokenizer(args.model_path)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-serving-spec-"))
    rows: list[dict] = []
    try:
        with ProcessGroup(log_dir) as group:
            started = {}
            for system in systems:
                settings = deployments.WorkerSettings(
                    model_path=str(args.model_path), backend=args.transfer_backend, dtype=args.dtype,
                    num_pages=args.num_pages, worker_flags=system.worker_flags)
                started[system.name] = deployments.start(group, "pd", settings, cores)
            for name, deployment in started.items():
                wait_healthy(deployment.url)
                print(f"{name}: {deployment.url} ({deployment.describe()})")
            for index, concurrency in enumerate(concurrencies):
                seed = f"{args.seed}-{index}"
                request_class = RequestClass("random", args.input_len, args.output_len,
                                             concurrency * args.requests_per_client, rate=float("inf"))
                prompts = datasets.random_prompts(request_class, tokenizer, random.Random(seed))
                warmup = warmup_prompts(prompts, concurrency, tokenizer, seed, as_text=False)
                for system in systems if index % 2 == 0 else systems[::-1]:
                    rows.append(run_one(system, started[system.name], concurrency, (request_class, prompts),
                                        warmup, args, index))
    except NotReady as exc:
        print(f"pdserve bench serving-spec: a service did not start: {exc}\nlogs: {log_dir}", file=sys.stderr)
        return 1
    ratios = ratio_rows(rows)
    print("\n" + table(rows, ratios))
    summary = {"model": args.model_path.resolve().name, "dtype": args.dtype,
               "transfer_backend": args.transfer_backend, "cores": cores,
               "systems": {s.name: list(s.worker_flags) for s in systems},
               "workload": {"input_len": args.input_len, "output_len": args.output_len,
                            "requests_per_client": args.requests_per_client, "concurrencies": concurrencies},
               "rows": rows, "ratios": ratios, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
               "command": shlex.join(["pdserve", "bench", "serving-spec", *sys.argv[3:]])}
    report.write_json(args.output_dir / "serving_spec.json", summary)
    print(f"wrote {args.output_dir / 'serving_spec.json'}; logs in {log_dir}")
    return 0 if all(r["completed"] and not r["failed"] for r in rows) else 1
