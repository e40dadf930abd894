"""The bf16 GEMM of each C++ kernel variant on one decode step's linears, in one process (not a test):
`python -m tools.bench.gemm_variants --model DIR`.

Every variant this CPU runs (kernels.cpu_ext.executable_isas: avx512 and avx2 on an AVX-512 machine) is
loaded beside the others, and each times the step's linears of the checkpoint's shapes (every layer's
q/k/v, o, gate/up and down weights, and the lm_head: random bf16 weights, each its own tensor so that
the step streams them from memory as the engine does) at `--rows` rows, one variant after the other,
`--trials` times. On one thread it reads the stepping thread's CPU time, which other processes on a
shared machine barely move (their wall time they do); the best trial of each is reported, with its
ratio to the first variant's and its FMA instructions per second (rows x weights / lanes). The
variants' outputs are checked equal bit for bit first: they sum each output in the same order.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kernels import cpu_ext, cpu_kernels

LANES = {"avx512": 16, "avx2": 8}


def step_shapes(model: Path) -> list[tuple[int, int]]:
    """(out_features, in_features) of each linear a decode step runs, in order (dense models)."""
    config = json.loads((model / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    layer = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim),
             (2 * config["intermediate_size"], hidden), (hidden, config["intermediate_size"])]
    return layer * config["num_hidden_layers"] + [(config["vocab_size"], hidden)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.gemm_variants",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=Path(".cache/models/small"))
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--trials", type=int, default=9)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    variants = [v for v in cpu_ext.executable_isas()
                if cpu_ext.load(v) and cpu_ext.ops(v).bf16_gemm_supported()]
    if not variants:
        print("no built variant has the bf16 GEMM (run `make setup`)")
        return 1
    generator = torch.Generator().manual_seed(0)
    linears = []
    for out_features, in_features in step_shapes(args.model):
        weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
        x = torch.randn(args.rows, in_features, generator=generator).to(torch.bfloat16)
        linears.append((cpu_kernels.pack_bf16_gemm_weight(weight), out_features, x))
    first = [cpu_ext.ops(variants[0]).bf16_gemm(x, packed, None, n) for packed, n, x in linears]
    for variant in variants[1:]:
        same = all(torch.equal(cpu_ext.ops(variant).bf16_gemm(x, packed, None, n), ref)
                   for (packed, n, x), ref in zip(linears, first, strict=True))
        if not same:
            print(f"{variant.name} differs from {variants[0].name}: the variants must give the same bits")
            return 1
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    best = {v.name: float("inf") for v in variants}
    for _ in range(args.trials):
        for variant in variants:
            gemm = cpu_ext.ops(variant).bf16_gemm
            started = clock()
            for packed, n, x in linears:
                gemm(x, packed, None, n)
            best[variant.name] = min(best[variant.name], clock() - started)
    weights = sum(n * k for n, k in step_shapes(args.model))
    clock_name = "thread CPU time" if args.threads == 1 else "wall time"
    print(f"{len(linears)} linears of {args.model.name} ({weights / 1e6:.1f}M weights) at {args.rows} rows, "
          f"{args.threads} thread(s), best of {args.trials} by {clock_name}:")
    for name, seconds in best.items():
        fmas = args.rows * weights / LANES.get(name, 1) / seconds / 1e9
        print(f"  {name:9s} {1000 * seconds:8.1f} ms  {seconds / best[variants[0].name]:5.2f}x  "
              f"{fmas:5.2f} G FMA instructions/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
