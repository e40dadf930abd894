"""Workload spec parsing, arrivals, the local-prefill rule, and the report's figures on known inputs."""

from __future__ import annotations

import random

import pytest

from tools.bench.serving.client import RequestResult
from tools.bench.serving.metrics import Slo, peak_output_throughput, summarize
from tools.bench.serving.report import result_text
from tools.bench.serving.workload import RequestClass, WorkloadError, interruption_workload, parse_workload


def test_the_mixed_spec_parses_into_classes() -> None:
    classes = parse_workload("background: in=64 out=128 n=32 concurrency=8; "
                             "long: in=2048 out=8 n=4 rate=0.2 start=1")
    assert classes == [RequestClass("background", 64, 128, 32, concurrency=8),
                       RequestClass("long", 2048, 8, 4, rate=0.2, start_s=1.0)]


@pytest.mark.parametrize("spec, message", [
    ("", "empty"),
    ("bg in=1 out=1 n=1 rate=1", "expected 'NAME:"),
    ("bg: in=1 out=1 n=1", "exactly one of rate= "),
    ("bg: in=1 out=1 n=1 rate=1 concurrency=2", "exactly one of rate= "),
    ("bg: in=1 out=1 rate=1", "missing n"),
    ("bg: in=1 out=1 n=1 rate=1 colour=red", "unknown setting 'colour=red'"),
    ("bg: in=1.5 out=1 n=1 rate=1", "in='1.5' must be a whole number"),
    ("bg: in=x out=1 n=1 rate=1", "in='x' is not a number"),
    ("bg: in=0 out=1 n=1 rate=1", "in and out must be >= 1"),
    ("bg: in=1 out=1 n=1 rate=0", "rate must be > 0"),
    ("bg: in=1 out=1 n=1 rate=1; bg: in=1 out=1 n=1 rate=1", "names repeat"),
])
def test_bad_specs_name_the_problem(spec: str, message: str) -> None:
    with pytest.raises(WorkloadError, match=message.replace("(", r"\(").replace("'", "'")):
        parse_workload(spec)


def test_poisson_arrivals_are_seeded_and_at_the_rate() -> None:
    klass = RequestClass("c", 8, 8, 2000, rate=4.0, start_s=2.0)
    offsets = klass.arrival_offsets(random.Random(3))
    assert offsets == klass.arrival_offsets(random.Random(3))
    assert offsets[0] == 2.0 and offsets == sorted(offsets)
    assert (offsets[-1] - offsets[0]) / (len(offsets) - 1) == pytest.approx(0.25, rel=0.1)
    assert RequestClass("c", 8, 8, 3, rate=float("inf")).arrival_offsets(random.Random(0)) == [0.0, 0.0, 0.0]


def test_random_lengths_follow_the_range_ratio() -> None:
    lengths = RequestClass("c", 100, 10, 500, rate=1, range_ratio=0.5).lengths(random.Random(0))
    assert all(50 <= i <= 100 and 5 <= o <= 10 for i, o in lengths)
    assert RequestClass("c", 100, 10, 3, rate=1).lengths(random.Random(0)) == [(100, 10)] * 3


def test_interruption_workload_sizes_classes_by_duration() -> None:
    short, long = interruption_workload(2.0, 0.25, 40, short_in=64, short_out=128, long_in=2048, long_out=8)
    assert (short.num_requests, short.rate, short.input_len) == (80, 2.0, 64)
    assert (long.num_requests, long.rate, long.input_len, long.output_len) == (10, 0.25, 2048, 8)


def _result(ttft: float, itl: list[float], start: float = 0.0, klass: str = "c") -> RequestResult:
    times = [start + ttft]
    for gap in itl:
        times.append(times[-1] + gap)
    return RequestResult(klass, 10, len(itl) + 1, start=start, ok=True, ttft=ttft, latency=times[-1] - start,
                         prompt_tokens=10, output_tokens=len(itl) + 1, itl=list(itl), token_times=times)


def test_summary_figures_and_goodput() -> None:
    fast = _result(0.1, [0.01] * 9)
    stalled = _result(0.1, [0.01] * 8 + [0.5])  # one prefill interruption
    slow_start = _result(2.0, [0.01] * 9)
    failed = RequestResult("c", 10, 10, error="HTTP 503")
    summary = summarize([fast, stalled, slow_start, failed], duration_s=4.0,
                        slo=Slo(ttft_ms=1000, itl_ms=100, itl_quantile=1.0))
    assert summary["completed"] == 3 and summary["failed"] == 1
    assert summary["total_output_tokens"] == 30 and summary["total_input_tokens"] == 30
    assert summary["request_throughput"] == pytest.approx(0.75)
    assert summary["mean_ttft_ms"] == pytest.approx(733.333, rel=1e-4)
    assert summary["max_itl_ms"] == pytest.approx(500)
    assert summary["mean_itl_ms"] == pytest.approx((26 * 10 + 500) / 27)
    assert summary["mean_tpot_ms"] == pytest.approx((10 + (80 + 500) / 9 + 10) / 3)
    assert summary["goodput"] == pytest.approx(0.25)  # only `fast` meets both objectives
    assert summary["slo_attainment"] == pytest.approx(0.25)
    # at the 0.9 quantile one stall in nine gaps is forgiven
    assert summarize([stalled], 1.0, Slo(itl_ms=100, itl_quantile=0.5))["goodput"] == 1.0
    assert "goodput" not in summarize([fast], 1.0, Slo())


def test_peak_output_throughput_counts_tokens_per_second() -> None:
    a = _result(0.0, [0.125] * 14)  # 15 tokens over 1.75 s: 8 in the first second, 7 in the next
    b = _result(0.5, [0.25] * 3)  # 4 tokens at 0.5-1.25 s: 2 in each second
    assert peak_output_throughput([a, b]) == 10


def test_report_has_the_seeds_layout() -> None:
    summary = summarize([_result(0.1, [0.01] * 9)], 1.0, Slo(ttft_ms=500))
    text = result_text(summary, backend="pdserve", request_rate=float("inf"), max_concurrency=8,
                       peak_concurrency=1)
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[1].startswith("Backend:") and lines[1].split()[1] == "pdserve"
    assert "Traffic request rate:                    inf" in text
    for header in ("End-to-End Latency", "Time to First Token", "Time per Output Token (excl. 1st token)",
                   "Inter-Token Latency"):
        assert any(line.strip("-") == header for line in lines), header
    for label in ("Mean TTFT (ms):", "P99 ITL (ms):", "P90 E2E Latency (ms):", "Request goodput (req/s):"):
        assert label in text
