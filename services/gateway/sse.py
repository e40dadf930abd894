"""Server-sent events as OpenAI streams them: `data: {json}\n\n` per event, `data: [DONE]` last.

`open_stream` waits for the first chunk BEFORE the HTTP response starts, so a request that fails
before producing anything (no healthy worker, bad input seen by the worker, retries exhausted)
still gets a proper status code and error body instead of a 200 stream with an error inside.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse

from services.gateway.choices import until_disconnected
from services.gateway.errors import GatewayError, error_body

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(payload: BaseModel | dict[str, Any]) -> str:
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def error_event(exc: GatewayError) -> str:
    return event(error_body(exc.status, exc.message, param=exc.param, code=exc.code))


class _Ended:
    """The stream ended before yielding anything."""


async def open_stream(request: Request, stream: AsyncIterator[Any]) -> Any:
    """The first item of `stream` (or an _Ended marker), watching for the client leaving meanwhile.
    Raises what the stream raised first (-> an error status). Returns None if the client left."""

    async def first() -> Any:
        try:
            return await anext(stream)
        except StopAsyncIteration:
            return _Ended()

    return await until_disconnected(request, first)


def is_end(item: Any) -> bool:
    return isinstance(item, _Ended)


def sse_response(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
