"""The OpenAI endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models.

Each handler: check the model name, build prompt token ids (chat template or prompt), check them
against the context, derive the sampling, run n choices per prompt through the dispatcher, and
answer in the OpenAI wire format, either whole or as server-sent events.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence

from fastapi import APIRouter, Request
from starlette.responses import Response

from services.gateway.choices import (
    ChoiceJob,
    ChoiceResult,
    collect_choices,
    stream_choices,
    until_disconnected,
)
from services.gateway.dispatcher import GenerationChunk
from services.gateway.errors import GatewayError
from services.gateway.guards import request_guards
from services.gateway.logprobs import chat_logprobs, completion_logprobs
from services.gateway.prompts import check_max_tokens, check_prompt, check_token_ids
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatMessageOut,
    Completion,
    CompletionChoice,
    ModelCard,
    ModelList,
    Usage,
)
from services.gateway.sampling import sampling_from_fields
from services.gateway.sse import DONE, error_event, event, is_end, open_stream, sse_response
from services.gateway.state import GatewayState

router = APIRouter()
log = logging.getLogger("pdserve.gateway")

# 499: the nginx convention for "client closed the request"; nobody reads it, metrics do.
CLIENT_CLOSED = 499


def gateway_state(request: Request) -> GatewayState:
    return request.app.state.gateway


def _usage(prompt_lengths: Sequence[int], completion_tokens: Sequence[int]) -> Usage:
    return Usage.of(sum(prompt_lengths), sum(completion_tokens))


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    state = gateway_state(request)
    return ModelList(data=[ModelCard(id=state.model_name, created=state.created,
                                     max_model_len=state.model_files.context_length)])


@router.get("/v1/models/{model_id:path}", response_model=ModelCard)
async def get_model(model_id: str, request: Request) -> ModelCard:
    state = gateway_state(request)
    state.check_model(model_id)
    return ModelCard(id=state.model_name, created=state.created, max_model_len=state.model_files.context_length)


# -- chat ---------------------------------------------------------------------------------------

@router.post("/v1/chat/completions", response_model=ChatCompletion)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response | ChatCompletion:
    state, guards = gateway_state(request), request_guards(request)
    model = state.check_model(body.model)
    check_token_ids(body.stop_token_ids or (), state.model_files, param="stop_token_ids")
    check_max_tokens(body.max_tokens, state.model_files, param="max_tokens")
    check_max_tokens(body.max_completion_tokens, state.model_files, param="max_completion_tokens")
    guards.check_fanout(1, body.n, prompt_param="messages", count_param="n")
    if not await guards.admit(request, model, body.n):
        return Response(status_code=CLIENT_CLOSED)
    prompt_ids = await guards.encoder.chat(body)
    check_prompt(prompt_ids, body.max_new_tokens, state.model_files, param="messages",
                 max_tokens_param="max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens")
    top_n = body.top_logprobs_wanted
    sampling = sampling_from_fields(
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p, seed=body.seed,
        max_new_tokens=body.max_new_tokens, stop=body.stop_list(), stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos, logprobs=body.logprobs, top_logprobs=top_n)
    request_id = state.new_request_id("chatcmpl")
    jobs = [ChoiceJob(i, f"{request_id}-{i}", model, prompt_ids, sampling.for_choice(i)) for i in range(body.n)]
    timers = [state.metrics.timer() for _ in jobs]
    created = int(time.time())

    def logprobs_of(tokens):
        return chat_logprobs(tokens, state.model_files, top_n) if body.logprobs else None

    if body.stream:
        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
            return event(ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices,
                                             usage=usage))

        def first_events() -> list[str]:
            return [chunk([ChatChunkChoice(index=job.index, delta=ChatDelta(role="assistant", content=""))])
                    for job in jobs]

        def token_event(position: int, item: GenerationChunk) -> str | None:
            if not item.text and item.finish_reason is None and not (body.logprobs and item.tokens):
                return None  # a token whose text the detokenizer holds back: nothing to show yet
            return chunk([ChatChunkChoice(index=jobs[position].index,
                                          delta=ChatDelta(content=item.text or None) if item.text else ChatDelta(),
                                          logprobs=logprobs_of(item.tokens) if item.tokens else None,
                                          finish_reason=item.finish_reason)])

        def usage_event(completion_tokens: int) -> str:
            return chunk([], Usage.of(len(prompt_ids), completion_tokens))

        return await _stream(request, state, jobs, timers, first_events, token_event,
                             usage_event if body.include_usage else None)

    results = await until_disconnected(request, lambda: collect_choices(state.dispatcher, jobs, timers))
    if results is None:
        return Response(status_code=CLIENT_CLOSED)
    choices = [ChatChoice(index=r.index, message=ChatMessageOut(content=r.text), logprobs=logprobs_of(r.tokens),
                          finish_reason=r.finish_reason) for r in results]
    return ChatCompletion(id=request_id, created=created, model=model, choices=choices,
                          usage=_usage([len(prompt_ids)], [r.completion_tokens for r in results]))


# -- text completions ---------------------------------------------------------------------------

@router.post("/v1/completions", response_model=Completion)
async def completions(body: CompletionRequest, request: Request) -> Response | Completion:
    state, guards = gateway_state(request), request_guards(request)
    model = state.check_model(body.model)
    check_token_ids(body.stop_token_ids or (), state.model_files, param="stop_token_ids")
    check_max_tokens(body.max_tokens, state.model_files, param="max_tokens")
    candidates = body.candidates
    generations = guards.check_fanout(body.prompt_count(), candidates, prompt_param="prompt",
                                      count_param="best_of" if candidates > body.n else "n")
    if not await guards.admit(request, model, generations):
        return Response(status_code=CLIENT_CLOSED)
    prompts = await guards.encoder.prompts(body.prompt, param="prompt")
    for prompt_ids in prompts:
        check_prompt(prompt_ids, body.max_new_tokens, state.model_files, param="prompt")
    top_n = body.logprobs or 0
    want_logprobs = body.logprobs is not None
    sampling = sampling_from_fields(
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p, seed=body.seed,
        max_new_tokens=body.max_new_tokens, stop=body.stop_list(), stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos, logprobs=want_logprobs or candidates > body.n, top_logprobs=top_n)
    request_id = state.new_request_id("cmpl")
    jobs = [ChoiceJob(p * candidates + j, f"{request_id}-{p * candidates + j}", model, prompt_ids,
                      sampling.for_choice(j))
            for p, prompt_ids in enumerate(prompts) for j in range(candidates)]
    timers = [state.metrics.timer() for _ in jobs]
    created = int(time.time())
    prompt_lengths = [len(prompt_ids) for prompt_ids in prompts]

    if candidates > body.n:  # best_of: every candidate must finish before the best are known
        results = await until_disconnected(request, lambda: collect_choices(state.dispatcher, jobs, timers))
        if results is None:
            return Response(status_code=CLIENT_CLOSED)
        best = best_of(results, len(prompts), candidates, body.n)
        choices = [CompletionChoice(index=r.index, text=r.text, finish_reason=r.finish_reason,
                                    logprobs=completion_logprobs(r.tokens, state.model_files, top_n)
                                    if want_logprobs else None) for r in best]
        usage = _usage(prompt_lengths, [r.completion_tokens for r in results])
        whole = Completion(id=request_id, created=created, model=model, choices=choices, usage=usage)
        if body.stream:
            return sse_response(_replay(whole, body.include_usage))
        return whole

    if body.stream:
        sent_text = [0] * len(jobs)  # text offset per choice, for logprobs.text_offset

        def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
            return event(Completion(id=request_id, created=created, model=model, choices=choices, usage=usage))

        def token_event(position: int, item: GenerationChunk) -> str | None:
            if not item.text and item.finish_reason is None and not (want_logprobs and item.tokens):
                return None
            logprobs = (completion_logprobs(item.tokens, state.model_files, top_n, sent_text[position])
                        if want_logprobs else None)
            sent_text[position] += len(item.text)
            return chunk([CompletionChoice(index=jobs[position].index, text=item.text, logprobs=logprobs,
                                           finish_reason=item.finish_reason)])

        def usage_event(completion_tokens: int) -> str:
            return chunk([], Usage.of(sum(prompt_lengths), completion_tokens))

        return await _stream(request, state, jobs, timers, list, token_event,
                             usage_event if body.include_usage else None)

    results = await until_disconnected(request, lambda: collect_choices(state.dispatcher, jobs, timers))
    if results is None:
        return Response(status_code=CLIENT_CLOSED)
    choices = [CompletionChoice(index=r.index, text=r.text, finish_reason=r.finish_reason,
                                logprobs=completion_logprobs(r.tokens, state.model_files, top_n)
                                if want_logprobs else None) for r in results]
    return Completion(id=request_id, created=created, model=model, choices=choices,
                      usage=_usage(prompt_lengths, [r.completion_tokens for r in results]))


def best_of(results: list[ChoiceResult], prompts: int, candidates: int, n: int) -> list[ChoiceResult]:
    """For each prompt, the `n` of its `candidates` results with the highest mean token logprob
    (OpenAI's "highest log probability per token"), re-indexed as choices p * n + i."""
    best = []
    for p in range(prompts):
        group = results[p * candidates:(p + 1) * candidates]
        ranked = sorted(group, key=_mean_logprob, reverse=True)[:n]
        for i, result in enumerate(ranked):
            result.index = p * n + i
            best.append(result)
    return best


def _mean_logprob(result: ChoiceResult) -> float:
    logprobs = [token.logprob for token in result.tokens if token.logprob is not None]
    return sum(logprobs) / len(logprobs) if logprobs else float("-inf")


async def _replay(whole: Completion, include_usage: bool) -> AsyncIterator[str]:
    """A finished completion as the stream of it: one chunk per choice, then the usage."""
    for choice in whole.choices:
        yield event(whole.model_copy(update={"choices": [choice], "usage": None}))
    if include_usage:
        yield event(whole.model_copy(update={"choices": []}))
    yield DONE


# -- streaming ----------------------------------------------------------------------------------

async def _stream(request: Request, state: GatewayState, jobs: list[ChoiceJob], timers,
                  first_events: Callable[[], list[str]],
                  token_event: Callable[[int, GenerationChunk], str | None],
                  usage_event: Callable[[int], str] | None) -> Response:
    """An SSE response over the merged choices. The first chunk is awaited before the response
    starts (errors before it get a status code); later failures end the stream with an error event."""
    stream = stream_choices(state.dispatcher, jobs, timers)
    first = await open_stream(request, stream)
    if first is None:
        return Response(status_code=CLIENT_CLOSED)
    results = [ChoiceResult(index=job.index) for job in jobs]

    async def body() -> AsyncIterator[str]:
        try:
            for line in first_events():
                yield line
            pending = [] if is_end(first) else [first]
            async for item in _chain(pending, stream):
                position, chunk = item
                results[position].add(chunk)
                line = token_event(position, chunk)
                if line is not None:
                    yield line
            if usage_event is not None:
                yield usage_event(sum(r.completion_tokens for r in results))
        except GatewayError as exc:
            yield error_event(exc)
        except Exception as exc:  # a gateway bug: still end the stream the way clients understand
            log.exception("stream %s failed", jobs[0].room)
            yield error_event(GatewayError(500, f"internal error: {type(exc).__name__}: {exc}"))
        finally:
            await stream.aclose()
        yield DONE

    return sse_response(body())


async def _chain(first: list, rest: AsyncIterator) -> AsyncIterator:
    for item in first:
        yield item
    async for item in rest:
        yield item
