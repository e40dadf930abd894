"""Reading a pdserve service's Prometheus /metrics page: plain text in, `{name{labels}: value}` out."""

from __future__ import annotations

import re
import urllib.request

_SAMPLE = re.compile(r"^(?P<name>[^\s{]+)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$")


def parse_samples(text: str) -> dict[str, float]:
    """The samples of an exposition page, keyed `name{labels}` as exposed (labels in exposition order)."""
    samples = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match:
            key = match["name"] + (f"{{{match['labels']}}}" if match["labels"] else "")
            samples[key] = float(match["value"])
    return samples


def sum_samples(samples: dict[str, float], name: str, **labels: str) -> float | None:
    """Sum of the samples of `name` whose labels include `labels`; None if the metric is not exposed."""
    total, seen = 0.0, False
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
            seen = True
    return total if seen else None


def scrape(url: str, timeout_s: float = 5.0) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return parse_samples(response.read().decode())
