"""Send a workload to a server and collect every request's timings, bounded in time.

Protocol: `run(batches, settings)` starts one sender per request class at the same instant. A
Poisson class releases its requests at their arrival offsets; a closed-loop class keeps
`concurrency` requests of its own in flight. `--max-concurrency` caps the requests in flight over
all classes (a released request waits for a slot, as in SGLang's bench_serving: its TTFT includes
that wait). When `max_duration_s` has passed, nothing new is sent; requests in flight get
`drain_s` more seconds to finish, then they are cancelled and counted as failed ("cut at the time
bound"), so a run always ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from tools.bench.serving.client import RequestResult, send
from tools.bench.serving.datasets import Prompt
from tools.bench.serving.workload import RequestClass


@dataclass(frozen=True)
class RunSettings:
    base_url: str
    model: str
    max_concurrency: int | None = None
    max_duration_s: float | None = None
    drain_s: float = 30.0
    ignore_eos: bool = True
    logprobs: bool = True
    endpoint: str = "completions"  # a key of client.ENDPOINTS
    seed: int = 1
    progress: bool = True


@dataclass
class RunOutcome:
    """Every request's result (sent ones; `not_sent` counts those the time bound skipped)."""

    results: list[RequestResult]
    duration_s: float
    started: float
    not_sent: int = 0
    cut: int = 0
    peak_concurrency: int = 0
    concurrency_samples: list[tuple[float, int]] = field(default_factory=list)


class _InFlight:
    """Counts requests in flight and remembers the peak and each change."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0
        self.samples: list[tuple[float, int]] = []

    def change(self, delta: int) -> None:
        self.now += delta
        self.peak = max(self.peak, self.now)
        self.samples.append((time.perf_counter(), self.now))


async def run(batches: Sequence[tuple[RequestClass, list[Prompt]]], settings: RunSettings) -> RunOutcome:
    total = sum(len(prompts) for _, prompts in batches)
    progress = _progress(total, settings.progress)
    slots = asyncio.Semaphore(settings.max_concurrency) if settings.max_concurrency else None
    in_flight = _InFlight()
    results: list[RequestResult] = []
    tasks: set[asyncio.Task] = set()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
    timeout = httpx.Timeout(None, connect=30.0)
    started = time.perf_counter()
    deadline = started + settings.max_duration_s if settings.max_duration_s else float("inf")

    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        async def one(prompt: Prompt) -> None:
            result = RequestResult(prompt.request_class, prompt.input_len, prompt.output_len,
                                   start=time.perf_counter())
            try:
                async with slots if slots is not None else contextlib.nullcontext():
                    in_flight.change(+1)
                    try:
                        result = await send(http, settings.base_url, settings.model, prompt,
                                            ignore_eos=settings.ignore_eos, logprobs=settings.logprobs,
                                            endpoint=settings.endpoint)
                    finally:
                        in_flight.change(-1)
            except asyncio.CancelledError:
                result.error = "cut at the time bound"
                raise
            finally:
                results.append(result)
                progress.update(1)

        def launch(prompt: Prompt) -> asyncio.Task:
            task = asyncio.create_task(one(prompt))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            return task

        async def poisson(request_class: RequestClass, prompts: list[Prompt]) -> None:
            offsets = request_class.arrival_offsets(random.Random(f"{settings.seed}-{request_class.name}"))
            for offset, prompt in zip(offsets, prompts, strict=True):
                if started + offset > deadline:
                    return
                await asyncio.sleep(max(0.0, started + offset - time.perf_counter()))
                launch(prompt)

        async def closed_loop(request_class: RequestClass, prompts: list[Prompt]) -> None:
            queue = list(reversed(prompts))
            await asyncio.sleep(max(0.0, started + request_class.start_s - time.perf_counter()))

            async def client() -> None:
                while queue and time.perf_counter() < deadline:
                    await launch(queue.pop())
            assert request_class.concurrency is not None
            await asyncio.gather(*(client() for _ in range(request_class.concurrency)))

        senders = [asyncio.create_task(poisson(c, p) if c.rate is not None else closed_loop(c, p))
                   for c, p in batches]
        try:
            await _until(asyncio.gather(*senders), deadline)
            for sender in senders:
                sender.cancel()  # the bound is reached: send nothing more
            await asyncio.gather(*senders, return_exceptions=True)
            if tasks:
                await _until(asyncio.gather(*tasks, return_exceptions=True), deadline + settings.drain_s)
        finally:
            for sender in senders:
                sender.cancel()
            cut = [task for task in tasks if not task.done()]
            for task in cut:
                task.cancel()
            await asyncio.gather(*senders, *cut, return_exceptions=True)
            progress.close()
    finished = [r.start + r.latency for r in results if r.ok]
    duration = (max(finished) if finished else time.perf_counter()) - started
    return RunOutcome(results=results, duration_s=max(duration, 1e-9), started=started,
                      not_sent=total - len(results), cut=len(cut), peak_concurrency=in_flight.peak,
                      concurrency_samples=in_flight.samples)


async def _until(awaitable, deadline: float) -> None:
    """Wait for `awaitable` until `deadline` (perf_counter); it keeps running if time is up."""
    future = asyncio.ensure_future(awaitable)
    future.add_done_callback(lambda done: done.cancelled() or done.exception())  # retrieved: no warning
    remaining = deadline - time.perf_counter()
    if remaining == float("inf"):
        await future
        return
    await asyncio.wait({future}, timeout=max(0.0, remaining))


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoProgress()
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc="requests", dynamic_ncols=True)
