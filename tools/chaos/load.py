"""Steady mixed load: greedy chat clients in a loop, each answer judged against the fault-free one.

Client i sends one request at a time, streaming when i is odd, cycling through the prompt set from
its own offset. Every finished request lands in a `Tally`: succeeded (text equals the fault-free
answer for that prompt), wrong (HTTP 200, complete, different text), failed_clear, failed_unclear
(see client.py), or hung. A request is hung when it has no answer `hung_after` seconds after the
later of its start and `detectable_at` (which a scenario moves to fault + lease bound when it injects
a fault). A hung request is still watched for `hung_wait` more seconds, so the report can say whether
it was answered late (and how) or never, then cancelled. After a failure a client waits a little
before its next request, as a real one would, so a dead gateway is not hammered in a tight loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from tools.chaos.client import TIMEOUT, Reply, chat

_BACKOFF_S = 0.25  # after a failed request
_MONITOR_PERIOD_S = 0.2


@dataclass
class Tally:
    """Outcomes of the requests of one scenario. `errors` counts failures by kind; `examples` keeps the
    first detail seen per kind (and per wrong answer), for the report."""

    sent: int = 0
    succeeded: int = 0
    failed_clear: int = 0
    failed_unclear: int = 0
    hung: int = 0
    wrong: int = 0
    errors: Counter = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)
    hung_details: list[str] = field(default_factory=list)

    def record(self, reply: Reply, expected: str, detail: str = "") -> None:
        if reply.ok:
            if reply.text == expected:
                self.succeeded += 1
                return
            self.wrong += 1
            at = next((i for i, (a, b) in enumerate(zip(expected, reply.text, strict=False)) if a != b),
                      min(len(expected), len(reply.text)))
            self._note("wrong", f"{detail} {reply.request_id}: differs from character {at}: expected "
                                f"...{expected[at:at + 40]!r}, got ...{reply.text[at:at + 40]!r}")
            return
        if reply.clear:
            self.failed_clear += 1
        else:
            self.failed_unclear += 1
        self._note(reply.kind, reply.error)

    def record_hung(self, detail: str) -> None:
        self.hung += 1
        self._note("hung", detail)
        self.hung_details.append(detail)

    def _note(self, kind: str, detail: str) -> None:
        self.errors[kind] += 1
        self.examples.setdefault(kind, detail)


@dataclass(eq=False)  # kept in a set by identity
class _InFlight:
    task: asyncio.Task
    started: float
    detail: str
    hung: bool = False


class SteadyLoad:
    """`clients` looping greedy clients against the gateway at `url`; `start()`, then `stop()` returns
    the Tally. `reference[i]` is the fault-free text of `prompts[i]`."""

    def __init__(self, url: str, model: str, prompts: Sequence[str], reference: Sequence[str], *,
                 clients: int, max_tokens: int, hung_after: float, hung_wait: float) -> None:
        self.url, self.model = url, model
        self.prompts, self.reference = prompts, reference
        self.clients, self.max_tokens = clients, max_tokens
        self.hung_after, self.hung_wait = hung_after, hung_wait
        self.tally = Tally()
        self.detectable_at = 0.0  # monotonic time; see the module docstring
        self._stopping = False
        self._inflight: set[_InFlight] = set()
        self._tasks: list[asyncio.Task] = []
        self._monitor_task: asyncio.Task | None = None
        self._paused = False

    def fault_at(self, detectable_at: float) -> None:
        """A fault was injected that the system can know about from `detectable_at` (monotonic)."""
        self.detectable_at = max(self.detectable_at, detectable_at)

    async def pause(self, seconds: float) -> None:
        """No traffic for `seconds`, counted from when the last request in flight finished."""
        self._paused = True
        try:
            while self._inflight:
                await asyncio.sleep(0.05)
            await asyncio.sleep(seconds)
        finally:
            self._paused = False

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._client(i), name=f"load-client-{i}")
                       for i in range(self.clients)]
        self._monitor_task = asyncio.create_task(self._monitor(), name="load-hung-monitor")

    async def stop(self) -> Tally:
        """Let every client finish (or time out) its current request, then return the tally."""
        self._stopping = True
        await asyncio.gather(*self._tasks)
        if self._monitor_task is not None:
            self._monitor_task.cancel()
            await asyncio.gather(self._monitor_task, return_exceptions=True)
        return self.tally

    async def abort(self) -> None:
        """Cancel everything now (the run is being torn down)."""
        tasks = [t for t in (*self._tasks, self._monitor_task) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def deadline(self, started: float) -> float:
        return max(started, self.detectable_at) + self.hung_after

    async def _client(self, index: int) -> None:
        stream = index % 2 == 1
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            turn = index
            while not self._stopping:
                if self._paused:
                    await asyncio.sleep(0.05)
                    continue
                prompt_index = turn % len(self.prompts)
                turn += 1
                started = time.monotonic()
                task = asyncio.create_task(chat(http, self.url, self.model, self.prompts[prompt_index],
                                                self.max_tokens, stream=stream))
                entry = _InFlight(task, started, f"prompt {prompt_index} ({'stream' if stream else 'whole'})")
                self._inflight.add(entry)
                self.tally.sent += 1
                try:
                    reply = await task
                except asyncio.CancelledError:
                    if not entry.hung:
                        raise  # the client itself is being cancelled
                    self.tally.record_hung(f"{entry.detail}: no answer after "
                                           f"{time.monotonic() - started:.0f}s")
                    continue
                finally:
                    self._inflight.discard(entry)
                if entry.hung:
                    verdict = "ok" if reply.ok and reply.text == self.reference[prompt_index] else (
                        "wrong" if reply.ok else reply.kind)
                    self.tally.record_hung(f"{entry.detail}: answered after "
                                           f"{time.monotonic() - started:.1f}s ({verdict})")
                    continue
                self.tally.record(reply, self.reference[prompt_index], entry.detail)
                if not reply.ok:
                    await asyncio.sleep(_BACKOFF_S)

    async def _monitor(self) -> None:
        while True:
            now = time.monotonic()
            for entry in list(self._inflight):
                deadline = self.deadline(entry.started)
                if now > deadline:
                    entry.hung = True
                if now > deadline + self.hung_wait:
                    entry.task.cancel()
            await asyncio.sleep(_MONITOR_PERIOD_S)
