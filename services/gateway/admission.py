"""Admission control: a bounded number of generations in flight per model, a bounded wait queue,
429 with Retry-After beyond it (load shedding instead of letting every client queue for minutes).

A request holds one slot per generation it starts (prompts x n, capped at the whole budget so
that any request can run alone), from before its prompt is tokenized until its response is fully
sent or the client is gone. A request that finds no free slots waits in FIFO order: only the head
of the queue may take slots, so a big request is not starved by small ones behind it. A full queue
or a wait longer than `queue_timeout_s` sheds the request.

Protocol: the handler calls `await admit(request, admission, slots)` once; the `AdmissionScope`
middleware around the app releases the ticket when the ASGI call ends, whatever way it ends
(a streamed body finishing, an exception, a disconnect, a cancellation).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from services.gateway.errors import GatewayError

_TICKETS = "pdserve.admission_tickets"


@dataclass(frozen=True)
class AdmissionLimits:
    max_running: int
    max_waiting: int
    queue_timeout_s: float
    retry_after_s: int


class Ticket:
    """Slots one request holds; `release()` gives them back (idempotent)."""

    def __init__(self, queue: AdmissionQueue, slots: int) -> None:
        self._queue = queue
        self.slots = slots

    def release(self) -> None:
        if self.slots:
            slots, self.slots = self.slots, 0
            self._queue._release(slots)


class AdmissionQueue:
    """The slots and wait queue of one model. Event-loop only (no locks)."""

    def __init__(self, model: str, limits: AdmissionLimits, on_shed: Callable[[str, str], None]) -> None:
        self.model = model
        self.limits = limits
        self._on_shed = on_shed
        self.running = 0  # slots held
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, slots: int) -> Ticket:
        """A ticket for `slots` slots, waiting for them if need be. Raises GatewayError(429)."""
        slots = max(1, min(slots, self.limits.max_running))
        if not self._waiters and self.running + slots <= self.limits.max_running:
            self.running += slots
            return Ticket(self, slots)
        if len(self._waiters) >= self.limits.max_waiting:
            raise self._shed("queue_full", f"the server is at capacity for model {self.model!r} "
                                           f"({self.limits.max_waiting} requests already waiting); retry later")
        entry = (slots, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(entry[1], self.limits.queue_timeout_s)
        except BaseException as exc:
            granted = entry[1].done() and not entry[1].cancelled()
            if granted:  # the slots arrived as the wait ended: hand them on
                self._release(slots)
            else:
                self._waiters.remove(entry)
                self._grant()  # the head may have left: the next one may fit now
            if isinstance(exc, asyncio.TimeoutError):
                raise self._shed("queue_timeout", f"waited {self.limits.queue_timeout_s:g}s for capacity for "
                                                  f"model {self.model!r}; retry later") from None
            raise
        return Ticket(self, slots)

    def _release(self, slots: int) -> None:
        self.running -= slots
        self._grant()

    def _grant(self) -> None:
        while self._waiters:
            slots, future = self._waiters[0]
            if self.running + slots > self.limits.max_running:
                return
            self._waiters.popleft()
            self.running += slots
            future.set_result(None)

    def _shed(self, reason: str, message: str) -> GatewayError:
        self._on_shed(self.model, reason)
        return GatewayError(429, message, code="server_overloaded",
                            headers={"Retry-After": str(self.limits.retry_after_s)})


class AdmissionControl:
    """One AdmissionQueue per model name, made on first use."""

    def __init__(self, limits: AdmissionLimits, on_shed: Callable[[str, str], None]) -> None:
        self.limits = limits
        self._on_shed = on_shed
        self.queues: dict[str, AdmissionQueue] = {}

    def queue(self, model: str) -> AdmissionQueue:
        queue = self.queues.get(model)
        if queue is None:
            queue = self.queues[model] = AdmissionQueue(model, self.limits, self._on_shed)
        return queue


async def admit(request: Request, control: AdmissionControl, model: str, slots: int) -> None:
    """Take `slots` for this request (waiting if need be); they are released when the request's
    ASGI call ends. Raises GatewayError(429) when shed; CancelledError if the client left."""
    ticket = await control.queue(model).acquire(slots)
    request.scope[_TICKETS].append(ticket)


class AdmissionScope:
    """Pure ASGI middleware: releases the admission tickets a request took, when its call ends."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tickets: list[Ticket] = []
        scope[_TICKETS] = tickets
        try:
            await self.app(scope, receive, send)
        finally:
            for ticket in tickets:
                ticket.release()
