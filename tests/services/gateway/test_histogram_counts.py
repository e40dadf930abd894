"""observe_times leaves a histogram as that many observe() calls would."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from services.gateway.histogram_counts import observe_times

BUCKETS = (0.001, 0.01, 0.1, 1.0)


def _pair() -> tuple[tuple[CollectorRegistry, Histogram], tuple[CollectorRegistry, Histogram]]:
    made = []
    for _ in range(2):
        registry = CollectorRegistry()
        made.append((registry, Histogram("gap_seconds", "gaps", buckets=BUCKETS, registry=registry)))
    return made[0], made[1]


def test_observe_times_matches_repeated_observe() -> None:
    (looped_registry, looped), (counted_registry, counted) = _pair()
    # on a bound, between bounds, past the last bound (+Inf), once, and not at all
    for value, count in ((0.01, 3), (0.05, 8), (2.0, 2), (0.0005, 1), (0.2, 0)):
        for _ in range(count):
            looped.observe(value)
        observe_times(counted, value, count)
    counted_samples, looped_samples = _samples(counted_registry), _samples(looped_registry)
    # the sum is value * count here, count additions there: equal up to rounding
    assert abs(counted_samples.pop("gap_seconds_sum") - looped_samples.pop("gap_seconds_sum")) < 1e-12
    assert counted_samples == looped_samples
    assert counted_samples['gap_seconds_bucket{le="0.01"}'] == 4.0
    assert counted_samples["gap_seconds_count"] == 14.0


def _samples(registry: CollectorRegistry) -> dict[str, float]:
    """name{labels} -> value, without the creation time (it differs between the two)."""
    samples = {}
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith("#") or "_created" in line:
            continue
        key, value = line.rsplit(" ", 1)
        samples[key] = float(value)
    return samples
