"""SimProfile: how long one engine step takes on the hardware a simulated worker stands for.

A step costs its decode rows' time plus its prompt tokens' time (a mixed step pays both), each read
off a piecewise-linear table of measured points and extended past its last point along the last
segment. The built-in table stands for one H100 serving a 4B dense model (Qwen3-4B shaped): batch 1
at 144 tok/s (SGLang with CUDA graphs, the seeds' figure), batch 100 at the 4,465 output tok/s the
seeds' prefill + decode pair streams at concurrency 100, and prompt tokens at about 40k tok/s. A
`--sim-profile` JSON file gives another table:

    {"decode_ms": [[batch, ms], ...], "prefill_ms": [[tokens, ms], ...]}
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path

Points = tuple[tuple[float, float], ...]

H100_4B_DECODE_MS: Points = ((1, 6.94), (16, 9.3), (100, 22.4), (256, 46.0))
H100_4B_PREFILL_MS: Points = ((1, 6.9), (512, 18.0), (4096, 102.0), (16384, 410.0))


def _interpolate(points: Points, x: float) -> float:
    """`points`' piecewise-linear value at x; along the first or last segment outside them."""
    xs = [p[0] for p in points]
    i = min(max(bisect.bisect_left(xs, x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def _checked(name: str, raw: object) -> Points:
    if not isinstance(raw, list) or len(raw) < 2:
        raise ValueError(f"sim profile: {name} must be a list of at least two [x, ms] points")
    points: list[tuple[float, float]] = []
    for point in raw:
        if not (isinstance(point, list) and len(point) == 2
                and all(isinstance(v, (int, float)) and v >= 0 for v in point)):
            raise ValueError(f"sim profile: each {name} point is [x, ms], both non-negative: {point!r}")
        points.append((float(point[0]), float(point[1])))
    if any(b[0] <= a[0] for a, b in zip(points, points[1:], strict=False)):
        raise ValueError(f"sim profile: {name} points must have increasing x")
    return tuple(points)


@dataclass(frozen=True)
class SimProfile:
    """Step-time tables (see the module docstring)."""

    decode_ms: Points = H100_4B_DECODE_MS
    prefill_ms: Points = H100_4B_PREFILL_MS

    @classmethod
    def load(cls, path: str | None) -> SimProfile:
        """The table in the JSON file at `path`, or the built-in one when None; ValueError naming
        what is wrong with a file."""
        if path is None:
            return cls()
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"sim profile {path}: {exc}") from None
        if not isinstance(raw, dict) or set(raw) != {"decode_ms", "prefill_ms"}:
            raise ValueError(f"sim profile {path}: expected an object with decode_ms and prefill_ms")
        return cls(_checked("decode_ms", raw["decode_ms"]), _checked("prefill_ms", raw["prefill_ms"]))

    def step_seconds(self, decode_rows: int, prompt_tokens: int) -> float:
        """Modeled seconds of one step with `decode_rows` decode rows and `prompt_tokens` prompt tokens."""
        ms = 0.0
        if decode_rows:
            ms += _interpolate(self.decode_ms, decode_rows)
        if prompt_tokens:
            ms += _interpolate(self.prefill_ms, prompt_tokens)
        return ms / 1000.0

    def decode_tokens_per_second(self, batch: int) -> float:
        """Output tokens per second of a steady decode batch of `batch` rows."""
        return batch / self.step_seconds(batch, 0)
