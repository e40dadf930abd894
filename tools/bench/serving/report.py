"""The seeds' "Serving Benchmark Result" block (SGLang's bench_serving layout) and the JSON file."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tools.bench.serving.runner import RunOutcome

_WIDTH = 50


def _rule(title: str, fill: str) -> str:
    return f"{title:{fill}^{_WIDTH}}"


def _line(label: str, value) -> str:
    if isinstance(value, float):
        value = "inf" if math.isinf(value) else f"{value:.2f}"
    return f"{label:<40} {value!s:<10}"


def _latency_block(title: str, name: str, label: str, summary: dict, quantiles: tuple[int, ...]) -> list[str]:
    lines = [_rule(title, "-"), _line(f"Mean {label} (ms):", summary[f"mean_{name}_ms"]),
             _line(f"Median {label} (ms):", summary[f"median_{name}_ms"])]
    lines += [_line(f"P{q} {label} (ms):", summary[f"p{q}_{name}_ms"]) for q in quantiles]
    return lines


def result_text(summary: dict, *, backend: str, request_rate: float, max_concurrency: int | None,
                peak_concurrency: int, slo_text: str = "", per_class: dict[str, dict] | None = None) -> str:
    """The report as SGLang prints it, plus goodput (when SLOs were given) and one block per
    request class of a mixed workload."""
    lines = [_rule(" Serving Benchmark Result ", "="),
             _line("Backend:", backend),
             _line("Traffic request rate:", request_rate),
             _line("Max request concurrency:", max_concurrency if max_concurrency else "not set"),
             _line("Successful requests:", summary["completed"]),
             _line("Failed requests:", summary["failed"]),
             _line("Benchmark duration (s):", summary["duration"]),
             _line("Total input tokens:", summary["total_input_tokens"]),
             _line("Total generated tokens:", summary["total_output_tokens"]),
             _line("Request throughput (req/s):", summary["request_throughput"]),
             _line("Input token throughput (tok/s):", summary["input_throughput"]),
             _line("Output token throughput (tok/s):", summary["output_throughput"]),
             _line("Peak output token throughput (tok/s):", summary["max_output_tokens_per_s"]),
             _line("Peak concurrent requests:", peak_concurrency),
             _line("Total token throughput (tok/s):", summary["total_throughput"]),
             _line("Concurrency:", summary["concurrency"])]
    if "goodput" in summary:
        lines += [_line("Request goodput (req/s):", summary["goodput"]),
                  _line("SLO attainment (%):", summary["slo_attainment"] * 100),
                  _line("SLO:", slo_text)]
    lines += _latency_block("End-to-End Latency", "e2e_latency", "E2E Latency", summary, (90, 99))
    lines += _latency_block("Time to First Token", "ttft", "TTFT", summary, (90, 99))
    lines += _latency_block("Time per Output Token (excl. 1st token)", "tpot", "TPOT", summary, (90, 99))
    lines += _latency_block("Inter-Token Latency", "itl", "ITL", summary, (90, 95, 99))
    lines.append(_line("Max ITL (ms):", summary["max_itl_ms"]))
    for name, part in (per_class or {}).items():
        lines.append(_rule(f"Class {name}", "-"))
        lines.append(_line("Successful requests:", f"{part['completed']} (failed {part['failed']})"))
        for label, key in (("TTFT", "ttft"), ("ITL", "itl"), ("E2E Latency", "e2e_latency")):
            lines.append(_line(f"Mean / P99 {label} (ms):",
                               f"{part[f'mean_{key}_ms']:.2f} / {part[f'p99_{key}_ms']:.2f}"))
        if "goodput" in part:
            lines.append(_line("Request goodput (req/s):", part["goodput"]))
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def requests_detail(outcome: RunOutcome) -> list[dict]:
    """Per request, for re-plotting: class, lengths, start (s after the run started), TTFT, E2E and
    its ITLs in ms, the server's token counts, or its error."""
    rows = []
    for r in sorted(outcome.results, key=lambda r: r.start):
        row = {"class": r.request_class, "input_len": r.input_len, "output_len": r.output_len,
               "start_s": round(r.start - outcome.started, 4), "ok": r.ok}
        if r.ok:
            row.update(ttft_ms=round(r.ttft * 1e3, 3), e2e_ms=round(r.latency * 1e3, 3),
                       prompt_tokens=r.prompt_tokens, output_tokens=r.output_tokens,
                       itl_ms=[round(gap * 1e3, 3) for gap in r.itl])
        else:
            row["error"] = r.error
        rows.append(row)
    return rows


def write_json(path: Path, payload: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))
    return path
