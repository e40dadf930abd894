"""The figures of a serving benchmark, named as SGLang's bench_serving names them in its JSON.

Definitions (as SGLang's, so numbers compare):
- TTFT: request sent to its first token. E2E latency: sent to the end of its stream.
- TPOT: (E2E - TTFT) / (output tokens - 1), per request; requests of one token have none.
- ITL: the gap between consecutive tokens of a request, over every gap of every request.
- Concurrency: the sum of E2E latencies over the benchmark duration (mean requests in flight).
- Peak output token throughput: the most tokens that arrived within one wall-clock second.
- Goodput: successful requests per second that met every SLO given: TTFT <= --slo-ttft-ms, the
  request's ITL at --slo-itl-quantile (default 0.99: about its second-slowest gap for 128 tokens)
  <= --slo-itl-ms, and TPOT <= --slo-tpot-ms. Prefill interruption shows up as a few long gaps
  in otherwise fast streams, which a mean (TPOT) hides and a high ITL quantile catches.
Percentiles are numpy's (linear interpolation), as SGLang's.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tools.bench.serving.client import RequestResult


@dataclass(frozen=True)
class Slo:
    """Service-level objectives a request must meet to count in goodput; None = not checked."""

    ttft_ms: float | None = None
    itl_ms: float | None = None
    tpot_ms: float | None = None
    itl_quantile: float = 0.99

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "itl_ms", "tpot_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"--slo-{name.replace('_ms', '')}-ms must be > 0, got {value}")
        if not 0 < self.itl_quantile <= 1:
            raise ValueError(f"--slo-itl-quantile must be in (0, 1], got {self.itl_quantile}")

    @property
    def given(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.itl_ms, self.tpot_ms))

    def met(self, result: RequestResult) -> bool:
        if not result.ok:
            return False
        if self.ttft_ms is not None and result.ttft * 1e3 > self.ttft_ms:
            return False
        if self.itl_ms is not None and result.itl:
            if float(np.quantile(result.itl, self.itl_quantile)) * 1e3 > self.itl_ms:
                return False
        tpot = result.tpot
        return not (self.tpot_ms is not None and tpot is not None and tpot * 1e3 > self.tpot_ms)

    def to_dict(self) -> dict:
        return {"ttft_ms": self.ttft_ms, "itl_ms": self.itl_ms, "tpot_ms": self.tpot_ms,
                "itl_quantile": self.itl_quantile}


def _stats(name: str, values_s: Sequence[float], quantiles: Sequence[int]) -> dict[str, float]:
    """mean/median/std/pNN of `values_s` (seconds) in ms, keyed `mean_{name}_ms` etc.; 0 when empty."""
    values = np.asarray(values_s, dtype=float) * 1e3
    empty = values.size == 0
    out = {f"mean_{name}_ms": 0.0 if empty else float(values.mean()),
           f"median_{name}_ms": 0.0 if empty else float(np.median(values)),
           f"std_{name}_ms": 0.0 if empty else float(values.std())}
    for q in quantiles:
        out[f"p{q}_{name}_ms"] = 0.0 if empty else float(np.percentile(values, q))
    return out


def peak_output_throughput(results: Sequence[RequestResult]) -> float:
    """The most tokens that arrived within one second (buckets of whole seconds from the first)."""
    times = [t for r in results if r.ok for t in r.token_times]
    if not times:
        return 0.0
    start = min(times)
    buckets = Counter(math.floor(t - start) for t in times)
    return float(max(buckets.values()))


def summarize(results: Sequence[RequestResult], duration_s: float, slo: Slo) -> dict:
    """SGLang-named figures over `results` (any subset: a whole run or one request class)."""
    ok = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_tokens or r.input_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    itls = [gap for r in ok for gap in r.itl]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    summary = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "input_throughput": input_tokens / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_throughput": (input_tokens + output_tokens) / duration_s,
        "max_output_tokens_per_s": peak_output_throughput(ok),
        "concurrency": sum(r.latency for r in ok) / duration_s,
        **_stats("e2e_latency", [r.latency for r in ok], (90, 99)),
        **_stats("ttft", [r.ttft for r in ok], (90, 99)),
        **_stats("tpot", tpots, (90, 99)),
        **_stats("itl", itls, (90, 95, 99)),
        "max_itl_ms": max(itls) * 1e3 if itls else 0.0,
    }
    if slo.given:
        good = sum(1 for r in ok if slo.met(r))
        summary["goodput"] = good / duration_s
        summary["slo_attainment"] = good / len(results) if results else 0.0
    return summary


def errors(results: Sequence[RequestResult], limit: int = 5) -> list[str]:
    """The most common error messages with their counts, for the report."""
    counted = Counter(r.error for r in results if not r.ok)
    return [f"{count} x {message}" for message, count in counted.most_common(limit)]
