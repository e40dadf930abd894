"""One value observed several times in a Prometheus histogram at the cost of one observation.

A streamed message of N tokens (--stream-interval N, or tokens that were ready together) hands N
tokens to the client at once, and the inter-token latency histogram counts each of them at the
message's gap / N. `Histogram.observe` takes one value at a time, so the relay called it N times per
message: its lock and bucket scan were a visible share of the gateway's CPU per relayed token.
`observe_times` adds N to the one bucket and N * value to the sum, which is exactly what N calls
would leave (the exposition is the same; tests/services/gateway/test_histogram_counts.py pins it).
It reads prometheus_client's histogram fields (`_upper_bounds`, `_buckets`, `_sum`), pinned in
pyproject; a histogram without them (another version) is observed one value at a time.
"""

from __future__ import annotations

from bisect import bisect_left

from prometheus_client import Histogram


def observe_times(histogram: Histogram, value: float, count: int) -> None:
    """`histogram.observe(value)` `count` times over."""
    if count <= 0:
        return
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if count == 1 or bounds is None or buckets is None or total is None:
        for _ in range(count):
            histogram.observe(value)
        return
    total.inc(value * count)
    # observe() counts a value in the first bucket whose upper bound is >= it (the last is +Inf)
    buckets[bisect_left(bounds, value)].inc(count)
