"""Time and profile decode steps of the engine: `python -m tools.bench.profile_step --model DIR`.

Drives the engine loop by hand (no engine thread): admits `--batch` random prompts, prefills them
in one step, runs warm-up decode steps, then times `--steps` steps (wall time, and the CPU time of
the stepping thread: with --threads 1 that figure barely moves when other processes load the
machine) and profiles `--profile-steps` more with torch.profiler, printing each op's time per step.

It uses only Engine.load, Engine.scheduler and Engine.step, so the same file also profiles an
older checkout: `PYTHONPATH=OLD_TREE python tools/bench/profile_step.py ...`, to compare two trees.

`--prefill` times whole prefills instead: one `--prompt-len` prompt at a time, in chunks of
`--chunk` tokens, `--repeats` times (wall and stepping-thread CPU time), then profiles one more and
splits its time into linear layers, extend attention and the rest. `--torch-extend` runs the torch
extend path (SDPA over gathered pages) with every other op unchanged: the "before" of the C++
extend kernel. This mode needs a tree with the engine's extend op (engine.models.attention).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from engine.config import EngineConfig

if __name__ == "__main__":  # run by path: this folder must not shadow the `engine` package
    sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.profile_step",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--rows", type=int, default=12, help="ops listed in the profile")
    parser.add_argument("--cpu-kernels", default=None, help="auto | on | off (older trees: leave unset)")
    parser.add_argument("--prefill", action="store_true",
                        help="time and profile whole prefills of one prompt")
    parser.add_argument("--chunk", type=int, default=EngineConfig.chunked_prefill_size,
                        help="--prefill: chunked_prefill_size")
    parser.add_argument("--repeats", type=int, default=3, help="--prefill: timed prefills")
    parser.add_argument("--torch-extend", action="store_true",
                        help="--prefill: torch SDPA for extend attention")
    args = parser.parse_args(argv)
    if args.prefill:
        return profile_prefill(args)

    from engine.engine import Engine
    from engine.request import EngineRequest
    from engine.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    extra = {} if args.cpu_kernels is None else {"cpu_kernels": args.cpu_kernels}
    tokens_per_request = args.prompt_len + args.steps + args.profile_steps + 16
    pages_per_request = -(-tokens_per_request // EngineConfig.page_size) + 1
    engine = Engine.load(EngineConfig(model_path=args.model, dtype=args.dtype, num_threads=args.threads,
                                      num_pages=args.batch * pages_per_request + 8,
                                      max_running_requests=args.batch,
                                      chunked_prefill_size=args.batch * args.prompt_len,
                                      **extra))
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_new_tokens=1 << 20, ignore_eos=True)
    for index in range(args.batch):
        prompt = torch.randint(10, engine.model_config.vocab_size, (args.prompt_len,),
                               generator=generator).tolist()
        engine.add_unstreamed(EngineRequest(f"profile-{index}", prompt, params))  # outputs dropped
    started = time.perf_counter()
    engine.thread.step()
    prefill_ms = 1000 * (time.perf_counter() - started)
    for _ in range(8):
        engine.thread.step()
    wall, cpu = [], []
    for _ in range(args.steps):
        started, started_cpu = time.perf_counter(), time.thread_time()
        engine.thread.step()
        cpu.append(1000 * (time.thread_time() - started_cpu))
        wall.append(1000 * (time.perf_counter() - started))
    print(f"batch {args.batch}, prompt {args.prompt_len}, {args.dtype}, {args.threads} threads: prefill step "
          f"{prefill_ms:.1f} ms; decode step median {statistics.median(wall):.2f} ms (min {min(wall):.2f}), "
          f"stepping thread CPU median {statistics.median(cpu):.2f} ms, over {args.steps} steps")

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.profile_steps):
            engine.thread.step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) / 1000 / args.profile_steps
    print(f"profile: {total:.2f} ms of op time per step (self CPU, calling thread), top ops:")
    for event in events[:args.rows]:
        per_step = event.self_cpu_time_total / 1000 / args.profile_steps
        print(f"  {per_step:7.3f} ms  {event.count / args.profile_steps:5.0f} calls  {event.key}")
    return 0


# Ops whose time is the linear layers' (packed oneDNN weights, else F.linear with its matmul inside).
LINEAR_OPS = ("mkldnn::_linear_pointwise", "aten::linear")
ATTENTION_RANGE = "extend_attention"


def profile_prefill(args: argparse.Namespace) -> int:
    from torch.profiler import ProfilerActivity, profile, record_function

    from engine.engine import Engine
    from engine.models.attention import extend_attention_torch
    from engine.request import EngineRequest
    from engine.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    extra = {} if args.cpu_kernels is None else {"cpu_kernels": args.cpu_kernels}
    engine = Engine.load(EngineConfig(model_path=args.model, dtype=args.dtype, num_threads=args.threads,
                                      num_pages=-(-args.prompt_len // EngineConfig.page_size) + 8,
                                      max_running_requests=1,
                                      chunked_prefill_size=args.chunk, **extra))
    ops = engine.model.ops
    extend_op = extend_attention_torch if args.torch_extend else ops.extend_attention

    def extend_attention(*inputs):  # the decoder looks the op up on `ops` at every layer
        with record_function(ATTENTION_RANGE):
            return extend_op(*inputs)

    ops.extend_attention = extend_attention
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True)

    def prefill(index: int) -> None:  # a new random prompt each time: no prefix cache hits
        prompt = torch.randint(10, engine.model_config.vocab_size, (args.prompt_len,),
                               generator=generator).tolist()
        engine.add_unstreamed(EngineRequest(f"prefill-{index}", prompt, params))
        while engine.scheduler.has_work():
            engine.thread.step()

    prefill(-1)  # warm-up
    wall, cpu = [], []
    for index in range(args.repeats):
        started, started_cpu = time.perf_counter(), time.thread_time()
        prefill(index)
        cpu.append(time.thread_time() - started_cpu)
        wall.append(time.perf_counter() - started)
    path = "torch SDPA over gathered pages" if args.torch_extend else type(ops).__name__ + ".extend_attention"
    print(f"prefill of a {args.prompt_len}-token prompt in chunks of {args.chunk}, {args.dtype}, "
          f"{args.threads} threads, extend attention by {path}: wall median {statistics.median(wall):.3f} s "
          f"(min {min(wall):.3f}), stepping thread CPU median {statistics.median(cpu):.3f} s, "
          f"over {args.repeats}")

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        prefill(args.repeats)
        profiled = time.perf_counter() - started
    events = prof.key_averages()
    linear = sum(e.cpu_time_total for e in events if e.key in LINEAR_OPS) / 1e6
    attention = sum(e.cpu_time_total for e in events if e.key == ATTENTION_RANGE) / 1e6
    rest = profiled - linear - attention
    print(f"profiled prefill {profiled:.3f} s: linear {linear:.3f} s, extend attention {attention:.3f} s "
          f"({attention / linear:.2f}x linear), rest {rest:.3f} s; (prefill - linear) / linear = "
          f"{(profiled - linear) / linear:.2f}")
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:args.rows]
    for event in top:
        print(f"  {event.self_cpu_time_total / 1e6:7.3f} s self  {event.count:6d} calls  {event.key}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
