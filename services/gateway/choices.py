"""Run the choices of one HTTP request (n samples x prompts) as concurrent generations.

`stream_choices` merges their chunks into one stream of (choice index, chunk) in arrival order;
`collect_choices` waits for all of them. Both cancel every generation still running when they
are left early (client gone, another choice failed), which cancels its gRPC call and aborts it on
the worker (see dispatcher.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from starlette.requests import Request

from services.gateway.dispatcher import Dispatcher, GeneratedToken, GenerationChunk
from services.gateway.metrics import RequestTimer
from services.gateway.sampling import Sampling

T = TypeVar("T")


@dataclass(frozen=True)
class ChoiceJob:
    """One generation of a request: its choice index, room id, prompt and sampling."""

    index: int
    room: str
    model: str
    prompt_token_ids: Sequence[int]
    sampling: Sampling


@dataclass
class ChoiceResult:
    """A finished choice, accumulated from its chunks."""

    index: int
    text: str = ""
    tokens: list[GeneratedToken] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, chunk: GenerationChunk) -> None:
        self.text += chunk.text
        self.tokens.extend(chunk.tokens)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.prompt_tokens = chunk.prompt_tokens
            self.completion_tokens = chunk.completion_tokens


_DONE = object()


async def stream_choices(dispatcher: Dispatcher, jobs: Sequence[ChoiceJob],
                         timers: Sequence[RequestTimer]) -> AsyncIterator[tuple[int, GenerationChunk]]:
    """(job index, chunk) from all jobs as they arrive. The first failing job's exception is
    raised (the others are cancelled). Each job's timer sees its tokens."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(position: int, job: ChoiceJob) -> None:
        try:
            async for chunk in dispatcher.generate(job.room, job.model, job.prompt_token_ids, job.sampling):
                await queue.put((position, chunk))
            await queue.put((position, _DONE))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # delivered to the consumer, which re-raises it
            await queue.put((position, exc))

    tasks = [asyncio.create_task(pump(position, job)) for position, job in enumerate(jobs)]
    running = len(tasks)
    try:
        while running:
            position, item = await queue.get()
            if item is _DONE:
                running -= 1
                timers[position].done()
                continue
            if isinstance(item, BaseException):
                raise item
            timers[position].tokens(len(item.tokens))
            yield position, item
    finally:
        for task in tasks:
            task.cancel()
        # let the cancellations run (each cancels its gRPC call and sends Worker.Abort) without
        # awaiting here: the caller may be inside a cancelled scope
        for task in tasks:
            task.add_done_callback(_consume_result)


def _consume_result(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


async def collect_choices(dispatcher: Dispatcher, jobs: Sequence[ChoiceJob],
                          timers: Sequence[RequestTimer]) -> list[ChoiceResult]:
    results = [ChoiceResult(index=job.index) for job in jobs]
    stream = stream_choices(dispatcher, jobs, timers)
    try:
        async for position, chunk in stream:
            results[position].add(chunk)
    finally:
        await stream.aclose()
    return results


async def until_disconnected(request: Request, work: Callable[[], Awaitable[T]]) -> T | None:
    """Run `work()`; if the client disconnects first, cancel it and return None. For responses
    that are not streamed (a streamed response notices the disconnect itself)."""
    work_task = asyncio.ensure_future(work())

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watch_task = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work_task.cancel()
        watch_task.cancel()
        raise
    watch_task.cancel()
    if work_task.done():
        return work_task.result()
    work_task.cancel()  # the client is gone: stop the generations, nobody is left to answer
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await work_task
    return None
