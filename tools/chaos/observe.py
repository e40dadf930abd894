"""What the suite reads from each worker's /metrics: KV pages in use, leak detections, work served.

- `pdserve:kv_pages_used`: pages held, reserved or running; idle value 0.
- `pdserve:kv_leak_detections_total`: the workers' own leak detector (pages in use while no room is
  live); None where a worker does not expose it yet.
- work served: a prefill counts `pdserve:prompt_tokens_total` (it has no finished requests), a decode
  `pdserve:request_success_total` without aborts. A counter that grew means the worker served.
- the gateway's `pdserve:gateway_retries_total{reason}`: attempts that failed on a worker and were
  retried on another, and `pdserve:gateway_migrations_total{reason}`: streams whose decode failed
  mid-stream, continued on another pair; the client never sees either, so they are read here.
Scrapes are async (a frozen worker accepts the connection and never answers), bounded by a timeout.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from tools.launch import Service
from tools.metrics import parse_samples, sum_samples

PAGES_USED = "pdserve:kv_pages_used"
LEAK_DETECTIONS = "pdserve:kv_leak_detections_total"
_SCRAPE_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class WorkerReading:
    """One scrape of one worker."""

    pages_used: float
    leak_detections: float | None
    served: float


def served_from(samples: dict[str, float], role: str) -> float:
    if role == "prefill":
        return sum_samples(samples, "pdserve:prompt_tokens_total") or 0.0
    finished = sum_samples(samples, "pdserve:request_success_total") or 0.0
    return finished - (sum_samples(samples, "pdserve:request_success_total", finish_reason="abort") or 0.0)


async def scrape_service(service: Service) -> dict[str, float] | None:
    """The service's /metrics samples, or None if it did not answer in time."""
    try:
        async with httpx.AsyncClient(timeout=_SCRAPE_TIMEOUT_S) as http:
            response = await http.get(f"http://{service.host}:{service.metrics_port}/metrics")
        response.raise_for_status()
    except httpx.HTTPError:
        return None
    return parse_samples(response.text)


async def read_worker(service: Service, role: str) -> WorkerReading | None:
    """The worker's reading, or None if its /metrics did not answer in time."""
    samples = await scrape_service(service)
    if samples is None:
        return None
    return WorkerReading(pages_used=sum_samples(samples, PAGES_USED) or 0.0,
                         leak_detections=sum_samples(samples, LEAK_DETECTIONS),
                         served=served_from(samples, role))


def grown(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    """The counts (by reason) that grew from `before` to `after`."""
    return {k: int(v - before.get(k, 0.0)) for k, v in after.items() if v > before.get(k, 0.0)}


RETRIES = "pdserve:gateway_retries_total"
MIGRATIONS = "pdserve:gateway_migrations_total"


async def gateway_retries(gateway: Service, counter: str = RETRIES) -> dict[str, float] | None:
    """Retried attempts (or, with `counter` MIGRATIONS, migrated streams) by reason, or None if
    the gateway's /metrics did not answer."""
    samples = await scrape_service(gateway)
    if samples is None:
        return None
    counts = {}
    for key, value in samples.items():
        if key.startswith(counter + "{") and 'reason="' in key:
            reason = key.split('reason="', 1)[1].split('"', 1)[0]
            counts[reason] = counts.get(reason, 0.0) + value
    return counts
