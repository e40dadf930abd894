"""The native endpoint of the seeds (SGLang's): POST /generate.

Body: `text` (string or batch) or `input_ids` (ids or batch), `sampling_params`
{temperature, max_new_tokens, top_p, top_k, min_p, stop, stop_token_ids, ignore_eos, seed}, `stream`.
Answer: {"text", "output_ids", "meta_info": {"id", "prompt_tokens", "completion_tokens",
"finish_reason": {"type": "stop" | "length" | "abort", ...}}} (a list for a batch). Streaming sends
the same object with the text so far after every chunk, then `data: [DONE]`, as SGLang does.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from starlette.responses import Response

from services.gateway.choices import (
    ChoiceJob,
    ChoiceResult,
    collect_choices,
    stream_choices,
    until_disconnected,
)
from services.gateway.errors import GatewayError, bad_request
from services.gateway.guards import request_guards
from services.gateway.prompts import check_max_tokens, check_prompt, check_token_ids
from services.gateway.protocol import NativeGenerateRequest
from services.gateway.responses import NativeGenerateResponse, NativeMetaInfo
from services.gateway.sampling import sampling_from_fields
from services.gateway.sse import DONE, error_event, event, is_end, open_stream, sse_response
from services.gateway.state import GatewayState

router = APIRouter()
log = logging.getLogger("pdserve.gateway")


def _finish_reason(result: ChoiceResult) -> dict | None:
    if result.finish_reason is None:
        return None
    if result.finish_reason == "length":
        return {"type": "length", "length": result.completion_tokens}
    return {"type": result.finish_reason}


def _response(result: ChoiceResult, room: str, prompt_tokens: int, return_logprob: bool) -> NativeGenerateResponse:
    logprobs = ([[token.logprob, token.token_id, None] for token in result.tokens] if return_logprob else None)
    return NativeGenerateResponse(
        text=result.text, output_ids=[token.token_id for token in result.tokens],
        meta_info=NativeMetaInfo(id=room, prompt_tokens=result.prompt_tokens or prompt_tokens,
                                 completion_tokens=result.completion_tokens or len(result.tokens),
                                 finish_reason=_finish_reason(result), output_token_logprobs=logprobs))


@router.post("/generate", response_model=NativeGenerateResponse | list[NativeGenerateResponse])
async def generate(body: NativeGenerateRequest, request: Request):
    state: GatewayState = request.app.state.gateway
    guards = request_guards(request)
    model = state.check_model(body.model)
    params = body.sampling_params
    check_token_ids(params.stop_token_ids or (), state.model_files, param="sampling_params.stop_token_ids")
    check_max_tokens(params.max_new_tokens, state.model_files, param="sampling_params.max_new_tokens")
    if body.stream and body.batched:
        raise bad_request("stream is supported for one prompt at a time", param="stream")
    prompt_param = "text" if body.text is not None else "input_ids"
    generations = guards.check_fanout(body.prompt_count(), 1, prompt_param=prompt_param, count_param=prompt_param)
    if not await guards.admit(request, model, generations):
        return Response(status_code=499)
    prompts = await guards.encoder.prompts(body.text if body.text is not None else body.input_ids,
                                           param=prompt_param)
    for prompt_ids in prompts:
        check_prompt(prompt_ids, params.max_new_tokens, state.model_files, param=prompt_param,
                     max_tokens_param="sampling_params.max_new_tokens")
    sampling = sampling_from_fields(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p, seed=params.seed,
        max_new_tokens=params.max_new_tokens, stop=params.stop_list(), stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos, logprobs=body.return_logprob, top_logprobs=body.top_logprobs_num)
    # The room is always the gateway's own unique id: a client's rid could collide with another
    # request's room on the workers (by accident or on purpose); it is only shown back.
    request_id = state.new_request_id("gen")
    jobs = [ChoiceJob(i, request_id if len(prompts) == 1 else f"{request_id}-{i}", model, prompt_ids, sampling)
            for i, prompt_ids in enumerate(prompts)]
    shown_ids = [job.room if body.rid is None else (body.rid if len(jobs) == 1 else f"{body.rid}-{job.index}")
                 for job in jobs]
    timers = [state.metrics.timer() for _ in jobs]

    if body.stream:
        return await _stream(request, state, jobs[0], shown_ids[0], timers, len(prompts[0]), body.return_logprob)

    results = await until_disconnected(request, lambda: collect_choices(state.dispatcher, jobs, timers))
    if results is None:
        return Response(status_code=499)
    responses = [_response(r, shown_id, len(job.prompt_token_ids), body.return_logprob)
                 for r, job, shown_id in zip(results, jobs, shown_ids, strict=True)]
    return responses if body.batched else responses[0]


async def _stream(request: Request, state: GatewayState, job: ChoiceJob, shown_id: str, timers,
                  prompt_tokens: int, return_logprob: bool) -> Response:
    stream = stream_choices(state.dispatcher, [job], timers)
    first = await open_stream(request, stream)
    if first is None:
        return Response(status_code=499)
    result = ChoiceResult(index=0)

    async def body() -> AsyncIterator[str]:
        try:
            pending = [] if is_end(first) else [first]
            for item in pending:
                result.add(item[1])
                yield event(_response(result, shown_id, prompt_tokens, return_logprob))
            async for _, chunk in stream:
                result.add(chunk)
                yield event(_response(result, shown_id, prompt_tokens, return_logprob))
        except GatewayError as exc:
            yield error_event(exc)
        except Exception as exc:
            log.exception("stream %s failed", job.room)
            yield error_event(GatewayError(500, f"internal error: {type(exc).__name__}: {exc}"))
        finally:
            await stream.aclose()
        yield DONE

    return sse_response(body())
