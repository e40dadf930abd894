"""The HTTP endpoints: the OpenAI API (POST /v1/chat/completions, POST /v1/completions,
GET /v1/models) and the seeds' native POST /generate (SGLang's).

Each handler: check the model name, the fan-out and the token budget, wait for admission
(middleware.RequestGuards), build prompt token ids (chat template or prompt, prompts.py), check
them against the context, turn the body's sampling into one proto per choice (protocol.py), run
the choices through the dispatcher and answer in the wire format, either whole or as server-sent
events (responses.py).

/generate body: `text` (string or batch) or `input_ids` (ids or batch), `image_data` (SGLang's: an
image or a list; for a batch one entry per prompt; the prompt holds one image-pad token per image,
as the chat template would write it), `sampling_params`
{temperature, max_new_tokens, top_p, top_k, min_p, stop, stop_token_ids, ignore_eos, seed}, `stream`.
Answer: {"text", "output_ids", "meta_info": {"id", "prompt_tokens", "completion_tokens",
"finish_reason": {"type": "stop" | "length" | "abort", ...}}} (a list for a batch). Streaming sends
the same object with the text so far after every chunk, then `data: [DONE]`, as SGLang does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

from fastapi import APIRouter, Request
from starlette.responses import Response

from services.gateway.chat_output import ChoiceParser, StreamedChoice, chat_parsing, message
from services.gateway.chunk_templates import ContentChunks
from services.gateway.errors import GatewayError, bad_request
from services.gateway.generation_chunk import GenerationChunk
from services.gateway.images import image_loader, image_urls
from services.gateway.large_bodies import LargeBodyRoute, decoded_images
from services.gateway.lora_routes import served_adapters
from services.gateway.middleware import request_guards
from services.gateway.prompts import check_max_tokens, check_prompt, check_token_ids
from services.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    NativeGenerateRequest,
    SamplingFields,
)
from services.gateway.responses import (
    CLIENT_CLOSED,
    DONE,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    ChoiceJob,
    ChoiceResult,
    Completion,
    CompletionChoice,
    ModelCard,
    ModelList,
    NativeGenerateResponse,
    NativeMetaInfo,
    RequestTimer,
    Usage,
    chat_logprobs,
    collect_choices,
    completion_logprobs,
    event,
    sse_response,
    stream_response,
)
from services.gateway.state import GatewayState
from services.gateway.tool_choice import plan_tools

router = APIRouter(route_class=LargeBodyRoute)  # large bodies parse off the event loop


def gateway_state(request: Request) -> GatewayState:
    return request.app.state.gateway


def served_model(state: GatewayState, requested: str | None) -> str:
    """The served model name if `requested` names it (or is omitted where that is allowed), or names
    a LoRA adapter of it (--enable-lora: the workers say whether they have it)."""
    if requested is None or requested == state.model_name or state.config.enable_lora:
        return state.model_name
    raise GatewayError(404, f"The model `{requested}` does not exist (this gateway serves "
                            f"`{state.model_name}`).", param="model", code="model_not_found")


def requested_adapter(state: GatewayState, requested: str | None) -> str | None:
    """The LoRA adapter a request's `model` names (None: the base model)."""
    if not state.config.enable_lora or requested is None or requested == state.model_name:
        return None
    return requested


def check_limits(state: GatewayState, sampling: SamplingFields, prefix: str = "",
                 **budgets: int | None) -> None:
    """400 for stop token ids outside the vocabulary or a token budget (`budgets`, by field name)
    no prompt leaves room for: what is refused before the request waits for admission. `prefix`
    locates the fields in the body."""
    check_token_ids(sampling.stop_token_ids or (), state.model_files, param=f"{prefix}stop_token_ids")
    for name, budget in budgets.items():
        check_max_tokens(budget, state.model_files, param=f"{prefix}{name}")


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _usage(prompt_lengths: Sequence[int], completion_tokens: Sequence[int]) -> Usage:
    return Usage.of(sum(prompt_lengths), sum(completion_tokens))


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    state = gateway_state(request)
    base = ModelCard(id=state.model_name, created=state.created,
                     max_model_len=state.model_files.context_length)
    adapters = [ModelCard(id=name, created=state.created, max_model_len=base.max_model_len, root=name,
                          parent=state.model_name) for name in await served_adapters(state)]
    return ModelList(data=[base, *adapters])


@router.get("/v1/models/{model_id:path}", response_model=ModelCard)
async def get_model(model_id: str, request: Request) -> ModelCard:
    state = gateway_state(request)
    served_model(state, model_id)
    return ModelCard(id=state.model_name, created=state.created,
                     max_model_len=state.model_files.context_length)


# -- chat ---------------------------------------------------------------------------------------

@router.post("/v1/chat/completions", response_model=ChatCompletion)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response | ChatCompletion:
    state, guards = gateway_state(request), request_guards(request)
    model = served_model(state, body.model)
    check_limits(state, body, max_tokens=body.max_tokens, max_completion_tokens=body.max_completion_tokens)
    guards.check_fanout(1, body.n, prompt_param="messages", count_param="n")
    tools = [tool.template_dict() for tool in body.tools] if body.tools is not None else None
    tool_plan = plan_tools(tools, body.tool_choice, body.parallel_tool_calls)
    if not await guards.admit(request, model, body.n):
        return Response(status_code=CLIENT_CLOSED)
    images = await image_loader(request).load(image_urls(body), multimodal=state.model_files.multimodal,
                                              param="messages", decoded=decoded_images(request))
    prompt_ids = await guards.encoder.chat(body, tool_plan.template_tools)
    parsers = state.text_parsers
    # the prompt's end says whether the template opened the thinking (only a reasoning parser asks)
    prompt_tail = state.model_files.text_of(prompt_ids[-8:]) if parsers.reasoning_parser else ""
    parsing = chat_parsing(tool_plan, parsers.tool_call_parser, parsers.reasoning_parser,
                           body.chat_template_kwargs, prompt_tail, state.model_files.special_token_ids)
    max_tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    check_prompt(prompt_ids, body.max_new_tokens, state.model_files, param="messages",
                 max_tokens_param=max_tokens_param)
    top_n = body.top_logprobs_wanted
    request_id = new_request_id("chatcmpl")
    lora = requested_adapter(state, body.model)
    jobs = [ChoiceJob(i, f"{request_id}-{i}", model, prompt_ids, parsing.constrain(body.sampling(i)),
                      tuple(images), lora) for i in range(body.n)]
    timers = [RequestTimer(state.metrics) for _ in jobs]
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

        streams = [StreamedChoice(parsing.parser()) for _ in jobs]
        content_chunks = [ContentChunks(request_id, created, model, job.index) for job in jobs]

        def token_event(position: int, item: GenerationChunk, so_far: ChoiceResult) -> str | None:
            finish_reason = item.finish_reason
            if streams[position].parser.plain:
                if item.text and finish_reason is None and not body.logprobs:  # most events: a template
                    return content_chunks[position].event(item.text)
                delta = ChatDelta(content=item.text or None)
            else:  # the text so far, parsed: only what is new is sent
                parsed = streams[position].step(so_far.text, final=finish_reason is not None)
                delta = ChatDelta(content=parsed.content, reasoning_content=parsed.reasoning,
                                  tool_calls=parsed.tool_calls or None)
                finish_reason = streams[position].finish_reason(finish_reason)
            if (delta.content is None and delta.reasoning_content is None and delta.tool_calls is None
                    and finish_reason is None and not (body.logprobs and item.tokens)):
                return None  # text the detokenizer or a parser holds back: nothing to show yet
            return chunk([ChatChunkChoice(index=jobs[position].index, delta=delta,
                                          logprobs=logprobs_of(item.tokens) if item.tokens else None,
                                          finish_reason=finish_reason)])

        usage_event = _usage_event(chunk, lambda results: _chat_prompt_tokens(prompt_ids, results),
                                   body.include_usage)
        return await stream_response(request, state.dispatcher, jobs, timers, token_event,
                                     first_events=first_events, usage_event=usage_event)

    results = await collect_choices(request, state.dispatcher, jobs, timers)
    if results is None:
        return Response(status_code=CLIENT_CLOSED)
    choices = [_chat_choice(r, parsing.parser(), logprobs_of(r.tokens)) for r in results]
    return ChatCompletion(id=request_id, created=created, model=model, choices=choices,
                          usage=_usage([_chat_prompt_tokens(prompt_ids, results)],
                                       [r.completion_tokens for r in results]))


def _chat_choice(result: ChoiceResult, parser: ChoiceParser, logprobs: ChatLogprobs | None) -> ChatChoice:
    if parser.plain:
        return ChatChoice(index=result.index, message=ChatMessageOut(content=result.text), logprobs=logprobs,
                          finish_reason=result.finish_reason)
    parts = message(parser, result.text)
    return ChatChoice(index=result.index, message=ChatMessageOut(
        content=parts.content, reasoning_content=parts.reasoning_content, tool_calls=parts.tool_calls),
        logprobs=logprobs, finish_reason=parts.finish_reason(result.finish_reason))


def _chat_prompt_tokens(prompt_ids: Sequence[int], results: Sequence[ChoiceResult]) -> int:
    """The prompt's length as the worker counted it: there each image counts its own tokens, here the
    prompt holds one image-pad token per image (the worker expands it). The gateway's count when no
    worker said (a stop string ended every choice at the gateway)."""
    return max((r.prompt_tokens for r in results), default=0) or len(prompt_ids)


def _usage_event(chunk, prompt_tokens: Callable[[list[ChoiceResult]], int], wanted: bool):
    """The stream's last chunk before [DONE] when the client asked for usage: no choices, the usage
    of all of them; None when it did not."""
    if not wanted:
        return None
    return lambda results: chunk([], Usage.of(prompt_tokens(results),
                                              sum(r.completion_tokens for r in results)))


# -- text completions ---------------------------------------------------------------------------

@router.post("/v1/completions", response_model=Completion)
async def completions(body: CompletionRequest, request: Request) -> Response | Completion:
    state, guards = gateway_state(request), request_guards(request)
    model = served_model(state, body.model)
    check_limits(state, body, max_tokens=body.max_tokens)
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
    request_id = new_request_id("cmpl")
    lora = requested_adapter(state, body.model)
    jobs = [ChoiceJob(p * candidates + j, f"{request_id}-{p * candidates + j}", model, prompt_ids,
                      body.sampling(j), lora=lora)
            for p, prompt_ids in enumerate(prompts) for j in range(candidates)]
    timers = [RequestTimer(state.metrics) for _ in jobs]
    created = int(time.time())
    prompt_lengths = [len(prompt_ids) for prompt_ids in prompts]

    def logprobs_of(tokens, text_offset: int = 0):
        return completion_logprobs(tokens, state.model_files, top_n, text_offset) if want_logprobs else None

    if candidates > body.n:  # best_of: every candidate must finish before the best are known
        results = await collect_choices(request, state.dispatcher, jobs, timers)
        if results is None:
            return Response(status_code=CLIENT_CLOSED)
        best = best_of(results, len(prompts), candidates, body.n)
        choices = [CompletionChoice(index=r.index, text=r.text, finish_reason=r.finish_reason,
                                    logprobs=logprobs_of(r.tokens)) for r in best]
        usage = _usage(prompt_lengths, [r.completion_tokens for r in results])
        whole = Completion(id=request_id, created=created, model=model, choices=choices, usage=usage)
        if body.stream:
            return sse_response(_replay(whole, body.include_usage))
        return whole

    if body.stream:
        sent_text = [0] * len(jobs)  # text offset per choice, for logprobs.text_offset

        def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
            return event(Completion(id=request_id, created=created, model=model, choices=choices,
                                    usage=usage))

        def token_event(position: int, item: GenerationChunk, _: ChoiceResult) -> str | None:
            if not item.text and item.finish_reason is None and not (want_logprobs and item.tokens):
                return None
            logprobs = logprobs_of(item.tokens, sent_text[position])
            sent_text[position] += len(item.text)
            return chunk([CompletionChoice(index=jobs[position].index, text=item.text, logprobs=logprobs,
                                           finish_reason=item.finish_reason)])

        return await stream_response(request, state.dispatcher, jobs, timers, token_event,
                                     usage_event=_usage_event(chunk, lambda _: sum(prompt_lengths),
                                                              body.include_usage))

    results = await collect_choices(request, state.dispatcher, jobs, timers)
    if results is None:
        return Response(status_code=CLIENT_CLOSED)
    choices = [CompletionChoice(index=r.index, text=r.text, finish_reason=r.finish_reason,
                                logprobs=logprobs_of(r.tokens)) for r in results]
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


# -- native /generate ---------------------------------------------------------------------------

def _finish_reason(result: ChoiceResult) -> dict | None:
    if result.finish_reason is None:
        return None
    if result.finish_reason == "length":
        return {"type": "length", "length": result.completion_tokens}
    return {"type": result.finish_reason}


def _native_response(result: ChoiceResult, room: str, prompt_tokens: int,
                     return_logprob: bool) -> NativeGenerateResponse:
    tokens = result.tokens  # listed once: ChoiceResult builds the list on each read
    logprobs = ([[token.logprob, token.token_id, None] for token in tokens]
                if return_logprob else None)
    return NativeGenerateResponse(
        text=result.text, output_ids=[token.token_id for token in tokens],
        meta_info=NativeMetaInfo(id=room, prompt_tokens=result.prompt_tokens or prompt_tokens,
                                 completion_tokens=result.completion_tokens or len(tokens),
                                 finish_reason=_finish_reason(result), output_token_logprobs=logprobs))


@router.post("/generate", response_model=NativeGenerateResponse | list[NativeGenerateResponse])
async def generate(body: NativeGenerateRequest, request: Request):
    state, guards = gateway_state(request), request_guards(request)
    model = served_model(state, body.model)
    params = body.sampling_params
    check_limits(state, params, "sampling_params.", max_new_tokens=params.max_new_tokens)
    if body.stream and body.batched:
        raise bad_request("stream is supported for one prompt at a time", param="stream")
    prompt_param = "text" if body.text is not None else "input_ids"
    generations = guards.check_fanout(body.prompt_count(), 1, prompt_param=prompt_param,
                                      count_param=prompt_param)
    try:
        image_sources = body.images_per_prompt()
    except ValueError as exc:
        raise bad_request(str(exc), param="image_data") from None
    if not await guards.admit(request, model, generations):
        return Response(status_code=CLIENT_CLOSED)
    loader, decoded = image_loader(request), decoded_images(request)
    images = [await loader.load(sources, multimodal=state.model_files.multimodal, param="image_data",
                                plain_base64=True, decoded=decoded) for sources in image_sources]
    prompts = await guards.encoder.prompts(body.prompt(), param=prompt_param)
    for prompt_ids in prompts:
        check_prompt(prompt_ids, params.max_new_tokens, state.model_files, param=prompt_param,
                     max_tokens_param="sampling_params.max_new_tokens")
    sampling = body.sampling()
    # The room is always the gateway's own unique id: a client's rid could collide with another
    # request's room on the workers (by accident or on purpose); it is only shown back.
    request_id = new_request_id("gen")
    lora = body.lora_path or requested_adapter(state, body.model)
    jobs = [ChoiceJob(i, request_id if len(prompts) == 1 else f"{request_id}-{i}", model, prompt_ids,
                      sampling, tuple(images[i]), lora)
            for i, prompt_ids in enumerate(prompts)]
    shown_ids = [job.room if body.rid is None else (body.rid if len(jobs) == 1 else f"{body.rid}-{job.index}")
                 for job in jobs]
    timers = [RequestTimer(state.metrics) for _ in jobs]

    if body.stream:
        def token_event(_: int, item: GenerationChunk, so_far: ChoiceResult) -> str:
            return event(_native_response(so_far, shown_ids[0], len(prompts[0]), body.return_logprob))

        return await stream_response(request, state.dispatcher, jobs, timers, token_event)

    results = await collect_choices(request, state.dispatcher, jobs, timers)
    if results is None:
        return Response(status_code=CLIENT_CLOSED)
    responses = [_native_response(r, shown_id, len(job.prompt_token_ids), body.return_logprob)
                 for r, job, shown_id in zip(results, jobs, shown_ids, strict=True)]
    return responses if body.batched else responses[0]
