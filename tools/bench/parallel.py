"""`pdserve bench parallel`: decode tokens/s and the bytes each collective moves per decode step, for
several rank layouts of one model, measured in one run.

    pdserve bench parallel --model tiny-deepseek --layouts tp1,tp2,pp2,dp2-ep2

A layout is `-`-joined parts: tpN, ppN, dpN (DP attention; tp defaults to dp), epN (tp defaults to
ep). Each runs in its own child process (rank groups form once per process), on the same prompts,
greedy, eos off, prefix cache off, every layout's ranks sharing `--threads` cores. Decode tokens/s
counts the tokens after every request has its first token, over the time from then to the last
token (pure decode steps). Bytes per decode step are rank 0's, over those steps, per collective:
all-reduce (TP sums, fp32 on the wire), all-gather (DP attention's token exchange), all-to-all
(expert parallelism's dispatch + combine, what rank 0 sent), stage (pipeline hand-offs: the residual
stream rank 0 sent to stage 1 and the fp32 logits it received from the last stage), plan (the step
plan rank 0 broadcasts). Where a layout needs more ranks than the machine has cores, its tokens/s
says how the machine copes, not how the layout scales.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import re
import time
from collections import Counter

KINDS = ("all_reduce", "all_gather", "all_to_all", "stage", "plan")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="a checkpoint folder or a tiny preset (tiny-deepseek, ...)")
    parser.add_argument("--layouts", default="tp1,tp2,pp2,dp2-ep2",
                        help="comma-separated layouts: tpN, ppN, dpN, epN joined with '-' "
                             "(default: %(default)s)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="cores shared by every layout's ranks")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def parse_layout(text: str) -> dict[str, int]:
    """'dp2-ep2' -> {'tp_size': 2, 'dp_size': 2, 'ep_size': 2, 'pp_size': 1}."""
    sizes = {"tp": 1, "pp": 1, "dp": 1, "ep": 1}
    given = set()
    for part in text.split("-"):
        match = re.fullmatch(r"(tp|pp|dp|ep)(\d+)", part)
        if match is None:
            raise SystemExit(f"pdserve bench parallel: bad layout part {part!r} in {text!r} "
                             "(tpN, ppN, dpN, epN)")
        sizes[match[1]] = int(match[2])
        given.add(match[1])
    if "tp" not in given:
        sizes["tp"] = max(sizes["dp"], sizes["ep"])
    return {f"{k}_size": v for k, v in sizes.items()}


def rank0_traffic(engine) -> Counter:
    """Rank 0's byte counts (engine.tp.group.TPGroup.traffic, and its MoE layers' all-to-all bytes
    sent); empty at one rank."""
    runner = engine.members[0].runner.stepper.driver if hasattr(engine, "members") else engine.runner
    group = getattr(runner, "group", None)
    traffic = Counter(group.traffic) if group is not None else Counter()
    load = engine.expert_load()
    if load is not None:
        traffic["all_to_all"] += load.a2a_sent_bytes
    return traffic


def _measure(model: str, layout: str, prompts: list[list[int]], new_tokens: int, threads: int, dtype: str,
             conn) -> None:
    import torch

    from engine.config import EngineConfig
    from engine.dp_engine import load_engine
    from engine.request import EngineRequest
    from engine.sampling import SamplingParams

    sizes = parse_layout(layout)
    ranks = sizes["tp_size"] * sizes["pp_size"]
    per_rank = max(1, threads // ranks)
    torch.set_num_threads(per_rank)
    pages = len(prompts) * (-(-(len(prompts[0]) + new_tokens) // 16) + 1) + 8
    engine = load_engine(EngineConfig(model_path=model, dtype=dtype, num_threads=per_rank, num_pages=pages,
                                      max_running_requests=len(prompts), disable_radix_cache=True,
                                      enable_dp_attention=sizes["dp_size"] > 1, **sizes))
    engine.start()
    try:
        params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
        marks: dict[str, object] = {}
        started: set[int] = set()

        async def one(index: int) -> None:
            request = engine.check(EngineRequest(f"{layout}-{index}", prompts[index], params))
            async for _batch in engine.generate(request):
                started.add(index)
                if "start" not in marks and len(started) == len(prompts):  # decode steps only from here
                    marks["start"] = (time.perf_counter(), rank0_traffic(engine), engine.stats())

        async def run() -> None:
            await asyncio.gather(*(one(i) for i in range(len(prompts))))

        asyncio.run(run())
        end, traffic, stats = time.perf_counter(), rank0_traffic(engine), engine.stats()
        start, traffic0, stats0 = marks["start"]  # type: ignore[misc]
        # One broadcast per step on rank 0 (a DP step runs every group's batch but counts once).
        steps = max(1, (traffic["broadcasts"] - traffic0["broadcasts"] if ranks > 1
                        else stats.steps - stats0.steps))
        decoded = stats.generated_tokens - stats0.generated_tokens
        conn.send({"layout": layout, "ranks": ranks, "decode_tokens_per_s": decoded / (end - start),
                   "decode_steps": steps,
                   "bytes_per_step": {kind: (traffic[kind] - traffic0[kind]) / steps for kind in KINDS}})
    except BaseException as exc:
        conn.send({"layout": layout, "error": f"{type(exc).__name__}: {exc}"})
        raise
    finally:
        engine.shutdown()


def run(model: str, layouts: list[str], batch: int, prompt_len: int, new_tokens: int, threads: int,
        dtype: str) -> list[dict]:
    from engine.models.config import ModelConfig
    from tools.bench.engine import make_prompts

    prompts = make_prompts(batch, prompt_len, ModelConfig.from_dir(model).vocab_size)
    context = multiprocessing.get_context("spawn")
    results = []
    for layout in layouts:
        parent, child = context.Pipe()
        proc = context.Process(target=_measure,
                               args=(model, layout, prompts, new_tokens, threads, dtype, child))
        proc.start()
        result = parent.recv() if parent.poll(900) else {"layout": layout, "error": "no result within 900 s"}
        proc.join(60)
        if proc.is_alive():
            proc.kill()
        results.append(result)
    return results


def main(args: argparse.Namespace) -> int:
    from tools.bench.kv_bytes import model_dir

    model = str(model_dir(args.model))
    layouts = [layout.strip() for layout in args.layouts.split(",") if layout.strip()]
    for layout in layouts:
        parse_layout(layout)  # refuse a bad one before starting anything
    results = run(model, layouts, args.batch, args.prompt_len, args.new_tokens, args.threads, args.dtype)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        _print_table(results, args)
    return 1 if any("error" in r for r in results) else 0


def _print_table(results: list[dict], args: argparse.Namespace) -> None:
    print(f"{args.model}: batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
          f"{args.dtype}, {args.threads} cores shared by each layout's ranks; bytes are rank 0's per "
          "decode step")
    base = next((r["decode_tokens_per_s"] for r in results if "error" not in r and r["ranks"] == 1), None)
    print(f"{'layout':<12}{'ranks':>6}{'tok/s':>9}{'vs 1 rank':>10}" + "".join(f"{k:>12}" for k in KINDS))
    for r in results:
        if "error" in r:
            print(f"{r['layout']:<12} failed: {r['error']}")
            continue
        ratio = f"{r['decode_tokens_per_s'] / base:.2f}x" if base else "-"
        print(f"{r['layout']:<12}{r['ranks']:>6}{r['decode_tokens_per_s']:>9.1f}{ratio:>10}"
              + "".join(f"{r['bytes_per_step'][k]:>12.0f}" for k in KINDS))
