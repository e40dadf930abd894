"""Measures the load benches share: a process tree's CPU seconds and a nearest-rank percentile."""

from __future__ import annotations

import psutil


def cpu_seconds(process: psutil.Process) -> float:
    """User + system CPU seconds of `process` and its living children, so far."""
    total = 0.0
    for proc in [process, *process.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            continue
    return total


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) of `values` by nearest rank; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
