"""After a scenario: did KV pages return to idle, and does every worker serve again?

`settle_pages` polls every worker's `pdserve:kv_pages_used` until it is back at its value from before
the scenario (0 for a worker started during it), up to `settle` seconds (longer than the transfer
timeout, after which quarantined pages must be free). Whatever is still above that is leaked.

`check_recovery` then asks: is every service alive, does the gateway see all four workers and say it
can serve, and does every worker serve new requests? It sends requests through the gateway (prompts
from the set, judged against the fault-free answers) until every worker's work counter has grown
(observe.py), within `recovery_timeout`. Any of these requests failing is reported: the fault is over
and every worker is back, so none should; nor should the gateway have to retry any of their attempts
(a retry hides a (prefill, decode) pair that stays broken while both workers serve other pairs).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from tools.chaos.client import TIMEOUT, chat
from tools.chaos.deployment import Deployment, role_of
from tools.chaos.load import Tally
from tools.chaos.observe import WorkerReading, gateway_retries, grown, read_worker
from tools.launch import Service

_BATCH = 4  # recovery requests in flight at once: spreads them over the workers
# Sent even when every worker has served sooner: with prefills taken in turn and decodes at random,
# each of the four (prefill, decode) pairs then gets about 4, so a pair that still fails shows.
_MIN_REQUESTS = 16


@dataclass(frozen=True)
class Baseline:
    """Per worker name: the process it was and its reading when the scenario started."""

    readings: dict[str, tuple[Service, WorkerReading | None]]

    def pages_before(self, name: str, service: Service) -> float:
        before = self.readings.get(name)
        if before is None or before[0] is not service or before[1] is None:
            return 0.0  # a worker (re)started during the scenario starts idle
        return before[1].pages_used

    def detections_before(self, name: str, service: Service) -> float:
        before = self.readings.get(name)
        if before is None or before[0] is not service or before[1] is None:
            return 0.0
        return before[1].leak_detections or 0.0


async def read_all(dep: Deployment) -> dict[str, WorkerReading | None]:
    names = list(dep.workers)
    readings = await asyncio.gather(*(read_worker(dep.workers[n], role_of(n)) for n in names))
    return dict(zip(names, readings, strict=True))


async def baseline_of(dep: Deployment) -> Baseline:
    readings = await read_all(dep)
    return Baseline({name: (dep.workers[name], readings[name]) for name in dep.workers})


@dataclass
class Settled:
    """Pages still held after the settle period: `leaked` above the scenario's start, per worker;
    `in_use` the absolute values; `unreachable` workers whose /metrics did not answer."""

    leaked: dict[str, float] = field(default_factory=dict)
    in_use: dict[str, float] = field(default_factory=dict)
    leak_detections: float | None = None
    unreachable: list[str] = field(default_factory=list)

    @property
    def pages_leaked(self) -> int:
        return int(sum(self.leaked.values()))


async def settle_pages(dep: Deployment, baseline: Baseline, timeout_s: float) -> Settled:
    deadline = time.monotonic() + timeout_s
    while True:
        readings = await read_all(dep)
        settled = Settled()
        detections, exposed = 0.0, False
        for name, reading in readings.items():
            service = dep.workers[name]
            if reading is None:
                settled.unreachable.append(name)
                continue
            settled.in_use[name] = reading.pages_used
            extra = reading.pages_used - baseline.pages_before(name, service)
            if extra > 0:
                settled.leaked[name] = extra
            if reading.leak_detections is not None:
                exposed = True
                detections += reading.leak_detections - baseline.detections_before(name, service)
        settled.leak_detections = detections if exposed else None
        if (not settled.leaked and not settled.unreachable) or time.monotonic() > deadline:
            return settled
        await asyncio.sleep(0.5)


@dataclass
class Recovery:
    """`recovered` when every service is alive and every worker served a request afterwards."""

    recovered: bool = True
    not_recovered: list[str] = field(default_factory=list)
    tally: Tally = field(default_factory=Tally)
    retries: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


async def check_recovery(dep: Deployment, prompts: Sequence[str], reference: Sequence[str], *,
                         max_tokens: int, timeout_s: float) -> Recovery:
    recovery = Recovery()
    for service in dep.services():
        if not service.alive():
            recovery.not_recovered.append(f"{service.name} (exited {service.popen.returncode})")
    deadline = time.monotonic() + timeout_s
    if not await dep.wait_gateway_sees_all(timeout_s):
        status, body = await dep.health()
        recovery.notes.append(f"gateway /health {status} {body.get('workers', body)} after {timeout_s:.0f}s")
    before = await read_all(dep)
    assert dep.gateway is not None
    retries_before = await gateway_retries(dep.gateway) or {}
    pending = {name for name in dep.workers if before.get(name) is not None}
    recovery.not_recovered += [f"{name} (no /metrics)" for name in dep.workers if before.get(name) is None]
    turn = 0
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        while (pending or turn < _MIN_REQUESTS) and time.monotonic() < deadline:
            batch = [(turn + i) % len(prompts) for i in range(_BATCH)]
            turn += _BATCH
            left = max(1.0, deadline - time.monotonic())
            replies = await asyncio.gather(*(
                asyncio.wait_for(chat(http, dep.url, dep.model_name, prompts[i], max_tokens,
                                      stream=i % 2 == 1), left)
                for i in batch), return_exceptions=True)
            for index, reply in zip(batch, replies, strict=True):
                recovery.tally.sent += 1
                if isinstance(reply, BaseException):
                    recovery.tally.record_hung(f"recovery request for prompt {index}: {type(reply).__name__}")
                else:
                    recovery.tally.record(reply, reference[index], f"recovery request, prompt {index}")
            now = await read_all(dep)
            for name in list(pending):
                was, is_ = before.get(name), now.get(name)
                if was is not None and is_ is not None and is_.served > was.served:
                    pending.discard(name)
    retries_after = await gateway_retries(dep.gateway) or {}
    recovery.retries = grown(retries_after, retries_before)
    recovery.not_recovered += [f"{name} (served nothing in {timeout_s:.0f}s)" for name in sorted(pending)]
    recovery.recovered = not recovery.not_recovered
    return recovery
