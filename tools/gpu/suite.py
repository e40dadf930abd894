"""Runs the parts of the GPU suite (tools.gpu.plan.PARTS) and prints the summary table.

Run by scripts/test_gpu.sh with the GPU venv's python, once that venv is complete:
`python -m tools.gpu.suite --parts parity,triton,pd,tp,graphs,bench --out DIR`. Each test part is one
pytest run (with -rs, so every skip prints its reason) writing a JUnit file that the table is read
from; the bench part writes the Qwen3-4B-shaped checkpoint (once, under .cache/models) and runs
`pdserve bench engine --device cuda` at batch 1, 16 and 64, each with CUDA graphs and without
(--eager-baseline), beside the GPU's memory bandwidth bound measured in the same run. Exit status 1
if any part failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from tools.gpu.plan import PART_NAMES, PARTS, REPO, check_parts

BENCH_MODEL = REPO / ".cache" / "models" / "qwen3-4b-shape"
BENCH_BATCHES = (1, 16, 64)
HF_BATCHES = (1, 16)  # HF's generate beside pdserve (at 64 it only adds minutes)


@dataclass
class Row:
    part: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    reason: str = ""
    seconds: float = 0.0


def row_from_junit(part: str, path: Path, returncode: int) -> Row:
    """Counts and the first failure or skip message of a pytest JUnit file. A run that wrote no file,
    or failed with nothing failing in it (a collection error), counts as one failure."""
    row = Row(part)
    if not path.exists():
        row.failed, row.reason = 1, f"pytest exited {returncode} without a report"
        return row
    failures, skips = [], []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            row.passed += 1
        elif outcome.tag == "skipped":
            row.skipped += 1
            skips.append(_skip_reason(outcome))
        else:
            row.failed += 1
            failures.append(f"{case.get('name')}: {outcome.get('message', '')}")
    if returncode not in (0, 5) and not failures:  # 5: nothing collected
        row.failed += 1
        failures.append(f"pytest exited {returncode}")
    first = (failures or skips or [""])[0]
    row.reason = first.splitlines()[0][:160] if first else ""
    return row


def _skip_reason(skipped: ET.Element) -> str:
    """A module-level skip's message is just "collection skipped"; its reason is in the element's
    text, a repr of (file, line, "Skipped: <reason>")."""
    text = skipped.text or ""
    if "Skipped: " in text:
        return text.split("Skipped: ", 1)[1].rstrip("')\"")
    return skipped.get("message", "")


def run_tests(part: str, paths: tuple[str, ...], out: Path) -> Row:
    junit = out / f"{part}.xml"
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           f"--junitxml={junit}", *paths], cwd=REPO, env=_env())
    row = row_from_junit(part, junit, proc.returncode)
    row.seconds = time.monotonic() - started
    return row


def run_bench(out: Path, peer_python: str | None) -> Row:
    """The Qwen3-4B-shaped checkpoint's decode tokens/s on GPU 0 at batch 1, 16 and 64 (bf16, 128-token
    prompts, 128 new tokens), graphs on and off, printed beside the GPU's bandwidth bound and the
    seeds' 144 tok/s by the bench itself."""
    import torch

    from tools.bench.engine import SEED_FIGURE, print_table

    row = Row("bench")
    if not torch.cuda.is_available():
        row.skipped, row.reason = 1, "[gpu:bench] no CUDA: torch.cuda.is_available() is False"
        print(row.reason)
        return row
    started = time.monotonic()
    if not (BENCH_MODEL / "model.safetensors.index.json").exists():
        made = subprocess.run([sys.executable, "-m", "pdserve", "make-tiny-model",
                               "--preset", "qwen3-4b-shape", "--out", str(BENCH_MODEL)], cwd=REPO, env=_env())
        if made.returncode != 0:
            row.failed, row.reason = 1, f"make-tiny-model --preset qwen3-4b-shape exited {made.returncode}"
            return row
    figures = []
    for batch in BENCH_BATCHES:
        args = ["bench", "engine", "--model", str(BENCH_MODEL), "--device", "cuda", "--dtype", "bfloat16",
                "--batch", str(batch), "--prompt-len", "128", "--new-tokens", "128", "--repeats", "3",
                "--eager-baseline"]
        if batch not in HF_BATCHES:
            args.append("--skip-hf")
        if peer_python:
            args += ["--peer-python", peer_python]
        proc = subprocess.run([sys.executable, "-m", "pdserve", *args, "--json"], cwd=REPO, env=_env(),
                              stdout=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            row.failed += 1
            row.reason = f"bench engine --batch {batch} exited {proc.returncode} (its error is above)"
            continue
        row.passed += 1
        report = json.loads(proc.stdout)
        (out / f"bench-batch{batch}.json").write_text(json.dumps(report, indent=2))
        print_table(report)
        figures.append(_bench_figure(batch, report))
    if not peer_python:
        print("[gpu:bench] vLLM not measured: its CUDA wheel pins a torch of its own, so it needs a venv of "
              "its own; pass --vllm-python PATH (a venv with vllm) to set it beside pdserve in the same run")
    if figures:
        row.reason = ("; ".join(figures)
                      + f" (seeds: {SEED_FIGURE['decode_tokens_per_s']:.0f} tok/s at batch 1)")
    row.seconds = time.monotonic() - started
    return row


def _bench_figure(batch: int, report: dict) -> str:
    """One batch's summary: tok/s with graphs, without, and the share of the bandwidth bound."""
    figure = f"batch {batch}: {report['pdserve']['decode_tokens_per_s']:.0f} tok/s"
    if "pdserve_eager" in report:
        figure += f" (eager {report['pdserve_eager']['decode_tokens_per_s']:.0f})"
    if "pdserve_step_over_floor" in report:
        figure += f", {100 / report['pdserve_step_over_floor']:.0f}% of the bandwidth bound"
    return figure


def _env() -> dict[str, str]:
    # The repository first, then whatever PYTHONPATH already names (an offline machine may hold some of
    # pdserve's requirements in a folder of their own rather than in the interpreter's site-packages).
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=pythonpath)
    env.pop("TRITON_INTERPRET", None)  # the GPU suite compiles the kernels
    return env


def summary(rows: list[Row]) -> str:
    lines = [f"{'part':8s} {'passed':>6s} {'failed':>6s} {'skipped':>7s} {'time':>7s}  reason / result",
             "-" * 100]
    lines += [f"{r.part:8s} {r.passed:6d} {r.failed:6d} {r.skipped:7d} {r.seconds:6.0f}s  {r.reason}"
              for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.gpu.suite", description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PART_NAMES))
    parser.add_argument("--out", type=Path, default=REPO / ".cache" / "test-gpu")
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vLLM's CUDA build (bench)")
    args = parser.parse_args(argv)
    chosen = check_parts(args.parts)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for part in PARTS:
        if part.name not in chosen:
            continue
        print(f"\n===== [test-gpu] part {part.name}: {part.what}", flush=True)
        rows.append(run_bench(args.out, args.vllm_python) if part.name == "bench"
                    else run_tests(part.name, part.paths, args.out))
    table = summary(rows)
    (args.out / "summary.txt").write_text(table + "\n")
    print("\n" + table)
    return 1 if any(r.failed for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
