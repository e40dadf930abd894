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
from services.gateway.prompts import check_prompt, completion_prompts
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
    model = state.check_model(body.model)
    batched = isinstance(body.text, list) or (
        body.input_ids is not None and len(body.input_ids) > 0 and isinstance(body.input_ids[0], list))
    prompt = body.text if body.text is not None else body.input_ids
    if isinstance(prompt, list) and len(prompt) == 0:
        raise bad_request("text / input_ids must not be empty", param="text" if body.text is not None else "input_ids")
    prompts = completion_prompts(prompt, state.model_files)
    params = body.sampling_params
    for prompt_ids in prompts:
        check_prompt(prompt_ids, params.max_new_tokens, state.model_files, param="input_ids")
    sampling = sampling_from_fields(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p, seed=params.seed,
        max_new_tokens=params.max_new_tokens, stop=params.stop_list(), stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos, logprobs=body.return_logprob, top_logprobs=body.top_logprobs_num)
    request_id = body.rid or state.new_request_id("gen")
    jobs = [ChoiceJob(i, request_id if len(prompts) == 1 else f"{request_id}-{i}", model, prompt_ids, sampling)
            for i, prompt_ids in enumerate(prompts)]
    timers = [state.metrics.timer() for _ in jobs]

    if body.stream:
        if batched:
            raise bad_request("stream is supported for one prompt at a time", param="stream")
        return await _stream(request, state, jobs[0], timers, len(prompts[0]), body.return_logprob)

    results = await until_disconnected(request, lambda: collect_choices(state.dispatcher, jobs, timers))
    if results is None:
        return Response(status_code=499)
    responses = [_response(r, job.room, len(job.prompt_token_ids), body.return_logprob)
                 for r, job in zip(results, jobs, strict=True)]
    return responses if batched else responses[0]


async def _stream(request: Request, state: GatewayState, job: ChoiceJob, timers, prompt_tokens: int,
                  return_logprob: bool) -> Response:
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
                yield event(_response(result, job.room, prompt_tokens, return_logprob))
            async for _, chunk in stream:
                result.add(chunk)
                yield event(_response(result, job.room, prompt_tokens, return_logprob))
        except GatewayError as exc:
            yield error_event(exc)
        except Exception as exc:
            log.exception("stream %s failed", job.room)
            yield error_event(GatewayError(500, f"internal error: {type(exc).__name__}: {exc}"))
        finally:
            await stream.aclose()
        yield DONE

    return sse_response(body())
