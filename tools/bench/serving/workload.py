"""What a benchmark sends: request classes and when each request starts.

A workload is one or more request classes. Each class has an input and an output length, a number
of requests, and an arrival process: Poisson arrivals at `rate` requests/s (`inf`: all at once), or
a closed loop of `concurrency` clients that each send the next request when the last one finished.

The mixed-workload spec (`--workload`) writes classes as `NAME: key=value ...`, separated by `;`:

    background: in=64 out=128 n=64 concurrency=8; long: in=2048 out=8 n=4 rate=0.2

keys: `in` (prompt tokens), `out` (tokens to generate), `n` (requests), `rate` (req/s, Poisson) or
`concurrency` (closed loop), optional `start` (seconds after the run starts before the class's
first request) and `range` (SGLang's --random-range-ratio: lengths drawn in [range*len, len]).
This is the prefill-interruption workload: short requests decoding while long prompts arrive.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

_KEYS = {"in", "out", "n", "rate", "concurrency", "start", "range"}


class WorkloadError(ValueError):
    """A workload spec or flag combination that cannot be run; the message says which part."""


@dataclass(frozen=True)
class RequestClass:
    """One kind of request in a workload. Exactly one of `rate` and `concurrency` drives arrivals
    (`rate` may be inf: every request at the start)."""

    name: str
    input_len: int
    output_len: int
    num_requests: int
    rate: float | None = None
    concurrency: int | None = None
    start_s: float = 0.0
    range_ratio: float = 1.0

    def __post_init__(self) -> None:
        where = f"workload class {self.name!r}"
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise WorkloadError(f"{where}: a name is letters, digits, '-' or '_'")
        if self.input_len < 1 or self.output_len < 1:
            raise WorkloadError(f"{where}: in and out must be >= 1 "
                                f"(got in={self.input_len}, out={self.output_len})")
        if self.num_requests < 1:
            raise WorkloadError(f"{where}: n must be >= 1 (got {self.num_requests})")
        if (self.rate is None) == (self.concurrency is None):
            raise WorkloadError(f"{where}: give exactly one of rate= (Poisson arrivals) "
                                "or concurrency= (closed loop)")
        if self.rate is not None and not self.rate > 0:
            raise WorkloadError(f"{where}: rate must be > 0 (or inf), got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise WorkloadError(f"{where}: concurrency must be >= 1, got {self.concurrency}")
        if self.start_s < 0:
            raise WorkloadError(f"{where}: start must be >= 0, got {self.start_s}")
        if not 0.0 <= self.range_ratio <= 1.0:
            raise WorkloadError(f"{where}: range must be in [0, 1], got {self.range_ratio}")

    def lengths(self, rng: random.Random) -> list[tuple[int, int]]:
        """(input, output) length of each request: SGLang's random dataset draws each uniformly
        in [max(1, ratio * len), len]."""
        def draw(length: int) -> int:
            return rng.randint(max(1, int(length * self.range_ratio)), length)
        return [(draw(self.input_len), draw(self.output_len)) for _ in range(self.num_requests)]

    def arrival_offsets(self, rng: random.Random) -> list[float]:
        """Seconds after the run's start at which each request is released (Poisson classes only;
        a closed loop releases a request when one of its clients is free)."""
        if self.rate is None:
            return [self.start_s] * self.num_requests
        if math.isinf(self.rate):
            return [self.start_s] * self.num_requests
        offsets, now = [], self.start_s
        for _ in range(self.num_requests):
            offsets.append(now)
            now += rng.expovariate(self.rate)
        return offsets


def _number(name: str, key: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise WorkloadError(f"workload class {name!r}: {key}={text!r} is not a number") from None


def _integer(name: str, key: str, text: str) -> int:
    value = _number(name, key, text)
    if not value.is_integer():
        raise WorkloadError(f"workload class {name!r}: {key}={text!r} must be a whole number")
    return int(value)


def parse_workload(spec: str) -> list[RequestClass]:
    """Parse the `--workload` spec (module docstring). Raises WorkloadError naming the bad part."""
    classes = []
    for part in (p.strip() for p in spec.split(";")):
        if not part:
            continue
        name, colon, body = part.partition(":")
        name = name.strip()
        if not colon:
            raise WorkloadError(f"workload class {part!r}: "
                                "expected 'NAME: in=.. out=.. n=.. rate=..|concurrency=..'")
        values: dict[str, str] = {}
        for item in body.split():
            key, eq, value = item.partition("=")
            if not eq or key not in _KEYS:
                raise WorkloadError(f"workload class {name!r}: unknown setting {item!r} "
                                    f"(known: {', '.join(sorted(_KEYS))})")
            values[key] = value
        missing = {"in", "out", "n"} - set(values)
        if missing:
            raise WorkloadError(f"workload class {name!r}: missing {', '.join(sorted(missing))}")
        classes.append(RequestClass(
            name=name, input_len=_integer(name, "in", values["in"]),
            output_len=_integer(name, "out", values["out"]),
            num_requests=_integer(name, "n", values["n"]),
            rate=_number(name, "rate", values["rate"]) if "rate" in values else None,
            concurrency=(_integer(name, "concurrency", values["concurrency"])
                         if "concurrency" in values else None),
            start_s=_number(name, "start", values.get("start", "0")),
            range_ratio=_number(name, "range", values.get("range", "1"))))
    if not classes:
        raise WorkloadError("the workload spec is empty")
    names = [c.name for c in classes]
    if len(set(names)) != len(names):
        raise WorkloadError(f"workload class names repeat: {names}")
    return classes


def interruption_workload(short_rate: float, long_rate: float, duration_s: float, *, short_in: int,
                          short_out: int, long_in: int, long_out: int) -> list[RequestClass]:
    """The prefill-interruption workload of `bench pd-vs-colocated`: short requests arriving at
    `short_rate` (they decode most of the time) while long prompts arrive at `long_rate`, both
    Poisson, sized so that arrivals span about `duration_s`."""
    return [
        RequestClass("short", short_in, short_out, max(1, round(short_rate * duration_s)), rate=short_rate),
        RequestClass("long", long_in, long_out, max(1, round(long_rate * duration_s)), rate=long_rate,
                     start_s=min(1.0, duration_s / 4)),
    ]
