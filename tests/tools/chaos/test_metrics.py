"""Prometheus text as the workers expose it, read back into sums by name and labels."""

from __future__ import annotations

from tools.chaos.observe import served_from
from tools.metrics import parse_samples, sum_samples

PAGE = """# HELP pdserve:kv_pages_used KV pages in use
# TYPE pdserve:kv_pages_used gauge
pdserve:kv_pages_used{model="tiny",role="decode"} 7.0
pdserve:request_success_total{finish_reason="length",model="tiny",role="decode"} 5.0
pdserve:request_success_total{finish_reason="abort",model="tiny",role="decode"} 2.0
pdserve:prompt_tokens_total{model="tiny",role="decode"} 120.0
"""


def test_sums_by_name_and_labels():
    samples = parse_samples(PAGE)
    assert sum_samples(samples, "pdserve:kv_pages_used") == 7.0
    assert sum_samples(samples, "pdserve:request_success_total") == 7.0
    assert sum_samples(samples, "pdserve:request_success_total", finish_reason="abort") == 2.0


def test_a_metric_not_exposed_is_none_not_zero():
    assert sum_samples(parse_samples(PAGE), "pdserve:kv_leak_detections_total") is None


def test_work_served_by_role():
    samples = parse_samples(PAGE)
    assert served_from(samples, "decode") == 5.0  # finished requests, aborts excluded
    assert served_from(samples, "prefill") == 120.0  # a prefill finishes no request: prompt tokens
