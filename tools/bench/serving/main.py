"""`pdserve bench serving`: a load generator against any OpenAI-compatible server.

Flags are SGLang bench_serving's where they mean the same (`--dataset-name random|sharegpt`,
`--dataset-path`, `--num-prompts`, `--random-input-len`, `--random-output-len`,
`--random-range-ratio`, `--request-rate`, `--max-concurrency`, `--disable-tqdm`,
`--disable-ignore-eos`, `--seed`, `--host/--port`), plus `--base-url`, `--workload` (a mixed
workload, see workload.py), SLOs for goodput, `--max-duration` (the bound on sending) and
`--output-dir` (the JSON and the PNG). It speaks `/v1/completions` (random prompts as token ids)
or, with `--endpoint chat`, `/v1/chat/completions` (the prompt text as one user message), with
streaming, so pdserve's gateway, SGLang, vLLM and others run the same load. `--warmup-requests`
prompts of the same lengths, drawn apart from the measured ones (a warm-up must not fill the
prefix cache with a measured prompt), go first and are not counted. Example:

    pdserve bench serving --base-url http://127.0.0.1:8000 --model .cache/models/tiny \\
        --dataset-name random --random-input-len 256 --random-output-len 64 --num-prompts 100 \\
        --request-rate 4 --slo-ttft-ms 1000 --slo-itl-ms 100 --output-dir bench-out
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time
from pathlib import Path

import httpx

from tools.bench.serving import datasets, metrics, plots, report, runner, workload
from tools.bench.serving.account import ServingAccount
from tools.bench.serving.client import ENDPOINTS, send
from tools.bench.serving.workload import RequestClass, WorkloadError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument("--base-url",
                        help="the server's URL, e.g. http://127.0.0.1:8000 (default: from --host/--port)")
    server.add_argument("--host", default="127.0.0.1", help="server host when --base-url is not given")
    server.add_argument("--port", type=int, default=8000, help="server port when --base-url is not given")
    server.add_argument("--backend", default="pdserve", help="label printed in the report")
    server.add_argument("--endpoint", choices=tuple(ENDPOINTS), default="completions",
                        help="the OpenAI API spoken: /v1/completions (random prompts as token ids) or "
                        "/v1/chat/completions (the prompt text as one user message) (default completions)")
    server.add_argument("--model", help="model name sent in requests; a local checkpoint folder means its "
                        "folder name (pdserve's served name) and its tokenizer (default: the server's first "
                        "model)")
    server.add_argument("--tokenizer", help="local checkpoint folder or tokenizer.json for building prompts "
                        "(default: --model when it is a local folder)")
    data = parser.add_argument_group("workload")
    data.add_argument("--dataset-name", choices=("random", "sharegpt"), default="random")
    data.add_argument("--dataset-path", help="ShareGPT-format JSON file (local) for --dataset-name sharegpt")
    data.add_argument("--num-prompts", type=int, default=1000, help="requests to send (default 1000)")
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=1024)
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="random lengths are drawn in [ratio * len, len] (SGLang's default 0.0)")
    data.add_argument("--sharegpt-output-len", type=int, help="tokens to generate per ShareGPT prompt "
                      "(default: the length of the conversation's reply)")
    data.add_argument("--workload", help="a mixed workload instead of the dataset flags, e.g. 'background: "
                      "in=64 out=128 n=64 concurrency=8; long: in=2048 out=8 n=4 rate=0.2' (random prompts)")
    data.add_argument("--request-rate", type=float, default=math.inf,
                      help="requests/s, Poisson arrivals (default inf: all at once)")
    data.add_argument("--max-concurrency", type=int, help="most requests in flight at once (default: no cap)")
    data.add_argument("--seed", type=int, default=1)
    data.add_argument("--disable-ignore-eos", action="store_true", help="let requests stop at EOS")
    data.add_argument("--warmup-requests", type=int, default=1,
                      help="requests sent at once (and not counted) first, with other prompts than the "
                      "measured ones")
    bound = parser.add_argument_group("bounds")
    bound.add_argument("--max-duration", type=float, default=600.0,
                       help="seconds after which nothing new is sent (default 600)")
    bound.add_argument("--drain-timeout", type=float, default=60.0,
                       help="seconds requests in flight get after --max-duration before they are cut "
                       "(default 60)")
    slo = parser.add_argument_group("goodput")
    slo.add_argument("--slo-ttft-ms", type=float, help="TTFT objective (ms)")
    slo.add_argument("--slo-itl-ms", type=float,
                     help="objective (ms) for a request's ITL at --slo-itl-quantile")
    slo.add_argument("--slo-itl-quantile", type=float, default=0.99, help="default 0.99")
    slo.add_argument("--slo-tpot-ms", type=float, help="TPOT objective (ms)")
    out = parser.add_argument_group("output")
    out.add_argument("--output-dir", type=Path, default=Path("bench-serving"),
                     help="where the JSON and PNG go")
    out.add_argument("--tag", default="serving", help="file names: TAG.json and TAG.png (default serving)")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def slo_from_args(args: argparse.Namespace) -> metrics.Slo:
    return metrics.Slo(ttft_ms=args.slo_ttft_ms, itl_ms=args.slo_itl_ms, tpot_ms=args.slo_tpot_ms,
                       itl_quantile=args.slo_itl_quantile)


def dataset_classes(args: argparse.Namespace) -> list[RequestClass]:
    """The request classes the flags describe (one for a dataset, several for --workload)."""
    if args.workload:
        return workload.parse_workload(args.workload)
    rate = args.request_rate
    return [RequestClass(args.dataset_name, max(1, args.random_input_len), max(1, args.random_output_len),
                         args.num_prompts, rate=rate, range_ratio=args.random_range_ratio)]


def build_prompts(args: argparse.Namespace, classes: list[RequestClass],
                  tokenizer) -> list[tuple[RequestClass, list]]:
    rng = random.Random(args.seed)
    as_text = args.endpoint == "chat"
    if args.dataset_name == "sharegpt" and not args.workload:
        if not args.dataset_path:
            raise WorkloadError("--dataset-name sharegpt needs --dataset-path (a local ShareGPT JSON file)")
        prompts = datasets.sharegpt_prompts(args.dataset_path, args.num_prompts, tokenizer, rng,
                                            args.sharegpt_output_len)
        only = classes[0]
        return [(RequestClass(only.name, 1, 1, len(prompts), rate=only.rate), prompts)]
    return [(c, datasets.random_prompts(c, tokenizer, rng, as_text=as_text)) for c in classes]


def warmup_prompts(measured: list[datasets.Prompt], count: int, tokenizer, seed: int | str, *, as_text: bool,
                   output_len: int = 4) -> list[datasets.Prompt]:
    """`count` random prompts the lengths of the first measured ones, from their own seeded RNG: never
    a measured prompt (one sent first would hit the prefix cache when measured)."""
    lengths = [prompt.input_len for prompt in measured[:count]]
    rng = random.Random(f"{seed}-warmup")
    return [datasets.random_prompts(RequestClass("warmup", length, output_len, 1, rate=math.inf),
                                    tokenizer, rng, as_text=as_text)[0]
            for length in lengths]


def check_args(args: argparse.Namespace) -> None:
    """Refuse flag values that cannot run, naming the flag."""
    for flag, value in (("--num-prompts", args.num_prompts), ("--random-input-len", args.random_input_len),
                        ("--random-output-len", args.random_output_len)):
        if value < 1:
            raise WorkloadError(f"{flag} must be >= 1, got {value}")
    if not args.request_rate > 0:
        raise WorkloadError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise WorkloadError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not args.max_duration > 0 or args.drain_timeout < 0:
        raise WorkloadError("--max-duration must be > 0 and --drain-timeout >= 0")
    if args.warmup_requests < 0:
        raise WorkloadError(f"--warmup-requests must be >= 0, got {args.warmup_requests}")
    if not 0 <= args.random_range_ratio <= 1:
        raise WorkloadError(f"--random-range-ratio must be in [0, 1], got {args.random_range_ratio}")


def resolve_model(args: argparse.Namespace, base_url: str) -> tuple[str, str | None]:
    """(model name for requests, tokenizer path)."""
    tokenizer = args.tokenizer
    model = args.model
    if model and Path(model).is_dir():
        tokenizer = tokenizer or model
        model = Path(model).resolve().name
    if not model:
        try:
            listed = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"]
            model = listed[0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise WorkloadError(f"could not read the model name from {base_url}/v1/models ({exc}); "
                                "give --model") from None
    return model, tokenizer


async def warm_up(settings: runner.RunSettings, prompts: list[datasets.Prompt]) -> None:
    """Send the warm-up prompts at once (connections, first-request costs, a batch's worth of
    compiled or cached paths); they are not counted, and any failure ends the benchmark."""
    if not prompts:
        return
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30)) as http:
        results = await asyncio.gather(*(send(http, settings.base_url, settings.model, prompt,
                                              ignore_eos=settings.ignore_eos, logprobs=settings.logprobs,
                                              endpoint=settings.endpoint) for prompt in prompts))
    for result in results:
        if not result.ok:
            raise WorkloadError(f"a warm-up request to {settings.base_url} failed: {result.error}")


def benchmark(batches: list[tuple[RequestClass, list]], settings: runner.RunSettings, slo: metrics.Slo, *,
              output_dir: Path, tag: str, backend: str, request_rate: float, warmup: list[datasets.Prompt],
              title: str = "", account: ServingAccount | None = None) -> dict:
    """Run one benchmark, print the report, write TAG.json and TAG.png; returns the JSON payload.
    The `warmup` prompts are sent first, at once, and not counted (see warmup_prompts). With
    `account` (a deployment this process started), the payload's "account" is the run's
    serving-cost account (tools/bench/serving/account.py)."""
    asyncio.run(warm_up(settings, warmup))
    if account is not None:
        account.start()
    outcome = asyncio.run(runner.run(batches, settings))
    summary = metrics.summarize(outcome.results, outcome.duration_s, slo)
    if account is not None:
        summary["account"] = account.stop(summary["total_output_tokens"], summary.get("mean_tpot_ms"))
    per_class = {}
    if len(batches) > 1:
        for request_class, _ in batches:
            mine = [r for r in outcome.results if r.request_class == request_class.name]
            per_class[request_class.name] = metrics.summarize(mine, outcome.duration_s, slo)
    slo_text = ", ".join(f"{k}={v:g}" for k, v in slo.to_dict().items() if v is not None) if slo.given else ""
    print(report.result_text(summary, backend=backend, request_rate=request_rate,
                             max_concurrency=settings.max_concurrency,
                             peak_concurrency=outcome.peak_concurrency,
                             slo_text=slo_text, per_class=per_class))
    problems = metrics.errors(outcome.results)
    if problems or outcome.not_sent:
        print(f"not sent (time bound): {outcome.not_sent}; failed: " + ("; ".join(problems) or "none"))
    detail = report.requests_detail(outcome)
    payload = {"tag": tag, "backend": backend, "base_url": settings.base_url, "model": settings.model,
               "endpoint": ENDPOINTS[settings.endpoint].path, "warmup_requests": len(warmup),
               "request_rate": request_rate, "max_concurrency": settings.max_concurrency,
               "classes": [vars(c) for c, _ in batches], "slo": slo.to_dict(), "not_sent": outcome.not_sent,
               "cut": outcome.cut, "max_concurrent_requests": outcome.peak_concurrency, **summary,
               "per_class": per_class, "errors": problems, "requests": detail,
               "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    json_path = report.write_json(output_dir / f"{tag}.json", payload)
    png_path = plots.run_figure(detail, output_dir / f"{tag}.png",
                                title or f"{tag}: {backend} at {settings.base_url}")
    print(f"wrote {json_path} and {png_path}")
    return payload


def main(args: argparse.Namespace) -> int:
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    try:
        check_args(args)
        slo = slo_from_args(args)
        classes = dataset_classes(args)
        model, tokenizer_path = resolve_model(args, base_url)
        if not tokenizer_path:
            raise WorkloadError("give --tokenizer (a local checkpoint folder or tokenizer.json): prompts are "
                                "built with the served model's tokenizer")
        tokenizer = datasets.load_tokenizer(tokenizer_path)
        batches = build_prompts(args, classes, tokenizer)
        warmup = warmup_prompts([p for _, ps in batches for p in ps], args.warmup_requests, tokenizer,
                                args.seed, as_text=args.endpoint == "chat")
    except (WorkloadError, ValueError) as exc:
        print(f"pdserve bench serving: {exc}", file=sys.stderr)
        return 2
    settings = runner.RunSettings(base_url=base_url, model=model, max_concurrency=args.max_concurrency,
                                  max_duration_s=args.max_duration, drain_s=args.drain_timeout,
                                  ignore_eos=not args.disable_ignore_eos, endpoint=args.endpoint,
                                  seed=args.seed, progress=not args.disable_tqdm)
    try:
        payload = benchmark(batches, settings, slo, output_dir=args.output_dir, tag=args.tag,
                            backend=args.backend, request_rate=args.request_rate, warmup=warmup)
    except WorkloadError as exc:
        print(f"pdserve bench serving: {exc}", file=sys.stderr)
        return 1
    return 0 if payload["completed"] else 1
