"""The response side of a request: run its choices on the workers and answer in the OpenAI wire
format (SGLang's for /generate), whole or as server-sent events.

Choices: `stream_choices` runs the choices of one HTTP request (n samples x prompts) as concurrent
generations (dispatcher.py) and merges their chunks into one stream of (choice index, chunk) in
arrival order; `collect_choices` waits for all of them. Both cancel every generation still running
when they are left early (client gone, another choice failed), which cancels its gRPC call and
aborts it on the worker.

Streams (`stream_response`) are server-sent events as OpenAI streams them: `data: {json}\n\n` per
event, `data: [DONE]` last. The first chunk is awaited BEFORE the HTTP response starts, so a
request that fails before producing anything (no healthy worker, bad input seen by the worker,
retries exhausted) still gets a proper status code and error body instead of a 200 stream with an
error inside; a failure after it ends the stream with an error event, then `[DONE]`.

Timing: each choice's `RequestTimer` records the latencies the client sees (TTFT, ITL, e2e in
GatewayMetrics) as its tokens are handed to the response.

Bodies are pydantic models whose field order and names follow the OpenAI API reference (`None`
fields are sent as null, as OpenAI does): the official `openai` client parses them unchanged,
streaming chunks included. Token logprobs come in the OpenAI shapes: chat's `logprobs.content`
list and the text completions' parallel `tokens` / `token_logprobs` / `top_logprobs` /
`text_offset` lists.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.responses import Response

from protos.v1 import common_pb2
from services.gateway.chat_output import ToolCall, ToolCallDelta
from services.gateway.dispatcher import Dispatcher
from services.gateway.errors import GatewayError, error_body
from services.gateway.generation_chunk import GeneratedToken, GenerationChunk
from services.gateway.histogram_counts import observe_times
from services.gateway.metrics import GatewayMetrics
from services.gateway.prompts import ModelFiles
from services.gateway.sse import SSEResponse

T = TypeVar("T")
log = logging.getLogger("pdserve.gateway")


class RequestTimer:
    """Client-side latencies of one choice: call `tokens(n)` as n tokens reach the client and
    `done()` at the end (TTFT once, ITL per token after the first, e2e at done)."""

    def __init__(self, metrics: GatewayMetrics, arrival: float | None = None) -> None:
        self.metrics = metrics
        self.arrival = time.perf_counter() if arrival is None else arrival
        self._last: float | None = None

    def tokens(self, count: int) -> None:
        if count <= 0:
            return
        now = time.perf_counter()
        if self._last is None:
            self.metrics.ttft.observe(now - self.arrival)
            count -= 1
        elif count > 0:
            observe_times(self.metrics.itl, (now - self._last) / count, count)
        self._last = now

    def done(self) -> None:
        self.metrics.e2e.observe(time.perf_counter() - self.arrival)

# 499: the nginx convention for "client closed the request"; nobody reads it, metrics do.
CLIENT_CLOSED = 499
DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# -- bodies -------------------------------------------------------------------------------------

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


# -- chat ---------------------------------------------------------------------------------------

class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # the thinking, split off by a --reasoning-parser
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


# -- text completions ---------------------------------------------------------------------------

class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    """Also the streaming chunk of /v1/completions (same object, partial text, usage null)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


# -- models -------------------------------------------------------------------------------------

class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    max_model_len: int | None = None
    root: str | None = None  # a LoRA adapter's own name (vLLM's)
    parent: str | None = None  # a LoRA adapter's base model (vLLM's)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- native /generate ---------------------------------------------------------------------------

class NativeMetaInfo(BaseModel):
    id: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: dict[str, Any] | None = None
    output_token_logprobs: list[list[Any]] | None = None


class NativeGenerateResponse(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: NativeMetaInfo


# -- logprobs ----------------------------------------------------------------------------------

def chat_logprobs(tokens: Sequence[GeneratedToken], model_files: ModelFiles, top_n: int) -> ChatLogprobs:
    content = []
    for token in tokens:
        shown = model_files.token_text(token.token_id)
        top = []
        for token_id, logprob in token.top_logprobs[:top_n]:
            alternative = model_files.token_text(token_id)
            top.append(TopLogprob(token=alternative.text, logprob=logprob, bytes=alternative.bytes))
        content.append(ChatTokenLogprob(token=shown.text,
                                        logprob=token.logprob if token.logprob is not None else 0.0,
                                        bytes=shown.bytes, top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(tokens: Sequence[GeneratedToken], model_files: ModelFiles, top_n: int,
                        text_offset: int = 0) -> CompletionLogprobs:
    """`text_offset` is where the first token's text starts in the choice's text (streaming: the
    length already sent)."""
    result = CompletionLogprobs(top_logprobs=[] if top_n > 0 else None)
    offset = text_offset
    for token in tokens:
        result.tokens.append(model_files.token_text(token.token_id).text)
        result.token_logprobs.append(token.logprob)
        result.text_offset.append(offset)
        offset += len(token.text)
        if result.top_logprobs is not None:
            result.top_logprobs.append({model_files.token_text(token_id).text: logprob
                                        for token_id, logprob in token.top_logprobs[:top_n]})
    return result


# -- choices -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChoiceJob:
    """One generation of a request: its choice index, room id, prompt and sampling."""

    index: int
    room: str
    model: str
    prompt_token_ids: Sequence[int]
    sampling: common_pb2.SamplingParams
    images: tuple[bytes, ...] = ()  # encoded images (services.gateway.images), for the worker
    lora: str | None = None  # the LoRA adapter to run under; None: the base model


@dataclass
class ChoiceResult:
    """A finished choice, accumulated from its chunks (their tokens are listed only when asked
    for: a streamed choice without logprobs never needs them)."""

    index: int
    text: str = ""
    chunks: list[GenerationChunk] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def tokens(self) -> list[GeneratedToken]:
        return [token for chunk in self.chunks for token in chunk.tokens]

    def add(self, chunk: GenerationChunk) -> None:
        self.text += chunk.text
        self.chunks.append(chunk)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.prompt_tokens = chunk.prompt_tokens
            self.completion_tokens = chunk.completion_tokens


_FINISHED = object()


async def stream_choices(dispatcher: Dispatcher, jobs: Sequence[ChoiceJob],
                         timers: Sequence[RequestTimer]) -> AsyncGenerator[tuple[int, GenerationChunk], None]:
    """(job index, chunk) from all jobs as they arrive. The first failing job's exception is
    raised (the others are cancelled). Each job's timer sees its tokens."""
    if len(jobs) == 1:  # most requests: no merging, so no task and queue hop per streamed chunk
        job, timer = jobs[0], timers[0]
        # iterated here, not through a generator of its own: every async generator between the gRPC
        # read and the HTTP write is resumed once per relayed message
        stream = dispatcher.generate(job.room, job.model, job.prompt_token_ids, job.sampling, job.images,
                                     lora=job.lora)
        finished = False
        try:
            async for chunk in stream:
                timer.tokens(len(chunk.token_ids))
                yield 0, chunk
            finished = True
        finally:
            if not finished:
                # the generation's own cleanup (cancel its call, Worker.Abort) runs as a task of its
                # own, as the merged path's cancelled pumps do: the caller may be inside a cancelled scope
                asyncio.ensure_future(stream.aclose()).add_done_callback(_consume_result)
        timer.done()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(position: int, job: ChoiceJob) -> None:
        try:
            async for chunk in dispatcher.generate(job.room, job.model, job.prompt_token_ids, job.sampling,
                                                   job.images, lora=job.lora):
                await queue.put((position, chunk))
            await queue.put((position, _FINISHED))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # delivered to the consumer, which re-raises it
            await queue.put((position, exc))

    tasks = [asyncio.create_task(pump(position, job)) for position, job in enumerate(jobs)]
    running = len(tasks)
    try:
        while running:
            position, item = await queue.get()
            if item is _FINISHED:
                running -= 1
                timers[position].done()
                continue
            if isinstance(item, BaseException):
                raise item
            timers[position].tokens(len(item.token_ids))
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


async def collect_choices(request: Request, dispatcher: Dispatcher, jobs: Sequence[ChoiceJob],
                          timers: Sequence[RequestTimer]) -> list[ChoiceResult] | None:
    """Every choice whole; None if the client left first (the generations are cancelled)."""

    async def collect() -> list[ChoiceResult]:
        results = [ChoiceResult(index=job.index) for job in jobs]
        stream = stream_choices(dispatcher, jobs, timers)
        try:
            async for position, chunk in stream:
                results[position].add(chunk)
        finally:
            await stream.aclose()
        return results

    return await until_disconnected(request, collect)


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


# -- server-sent events -------------------------------------------------------------------------

def event(payload: BaseModel | dict[str, Any]) -> str:
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def error_event(exc: GatewayError) -> str:
    return event(error_body(exc.status, exc.message, param=exc.param, code=exc.code))


def sse_response(body: AsyncIterator[str]) -> SSEResponse:
    return SSEResponse(body, headers=SSE_HEADERS)


class _Ended:
    """The stream ended before yielding anything."""


async def stream_response(request: Request, dispatcher: Dispatcher, jobs: Sequence[ChoiceJob],
                          timers: Sequence[RequestTimer],
                          token_event: Callable[[int, GenerationChunk, ChoiceResult], str | None], *,
                          first_events: Callable[[], list[str]] = list,
                          usage_event: Callable[[list[ChoiceResult]], str] | None = None) -> Response:
    """An SSE response over the merged choices: the `first_events()`, then per chunk
    `token_event(job position, chunk, the choice so far)` (None: nothing to send for it), then
    `usage_event(the finished choices)` if given. CLIENT_CLOSED if the client left
    before the first chunk; an error before it is raised (-> an error status)."""
    stream = stream_choices(dispatcher, jobs, timers)

    async def first() -> Any:
        try:
            return await anext(stream)
        except StopAsyncIteration:
            return _Ended()

    first_item = await until_disconnected(request, first)
    if first_item is None:
        return Response(status_code=CLIENT_CLOSED)
    results = [ChoiceResult(index=job.index) for job in jobs]

    def relayed(position: int, chunk: GenerationChunk) -> str | None:
        results[position].add(chunk)
        return token_event(position, chunk, results[position])

    async def body() -> AsyncIterator[str]:
        try:
            for line in first_events():
                yield line
            if not isinstance(first_item, _Ended):
                token_line = relayed(*first_item)
                if token_line is not None:
                    yield token_line
                async for position, chunk in stream:
                    token_line = relayed(position, chunk)
                    if token_line is not None:
                        yield token_line
            if usage_event is not None:
                yield usage_event(results)
        except GatewayError as exc:
            yield error_event(exc)
        except Exception as exc:  # a gateway bug: still end the stream the way clients understand
            log.exception("stream %s failed", jobs[0].room)
            yield error_event(GatewayError(500, f"internal error: {type(exc).__name__}: {exc}"))
        finally:
            await stream.aclose()
        yield DONE

    return sse_response(body())
