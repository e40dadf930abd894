"""How one HTTP answer is classified: complete text, clear failure (OpenAI error body or stream error
event) or unclear failure (anything else). The answers are crafted HTTP responses, to pin the rules."""

from __future__ import annotations

import json

import httpx
import pytest

from tools.chaos.client import chat

ERROR_BODY = {"error": {"message": "no workers serve model 'tiny'", "type": "service_unavailable_error",
                        "param": None, "code": "no_healthy_workers"}}


def _sse(*events: object, done: bool = True) -> bytes:
    lines = [f"data: {json.dumps(e)}\n\n" for e in events] + (["data: [DONE]\n\n"] if done else [])
    return "".join(lines).encode()


def _delta(text: str) -> dict:
    return {"id": "chatcmpl-2", "choices": [{"index": 0, "delta": {"content": text}}]}


async def _ask(response: httpx.Response | Exception, *, stream: bool):
    def handler(request: httpx.Request) -> httpx.Response:
        assert json.loads(request.content)["stream"] is stream
        if isinstance(response, Exception):
            raise response
        return response

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        return await chat(http, "http://gateway", "tiny", "hi", 4, stream=stream)


async def test_whole_answer():
    body = {"id": "chatcmpl-1", "choices": [{"message": {"content": "abc"}}]}
    reply = await _ask(httpx.Response(200, json=body), stream=False)
    assert reply.ok and reply.text == "abc" and reply.request_id == "chatcmpl-1"


async def test_error_status_with_openai_body_is_clear():
    reply = await _ask(httpx.Response(503, json=ERROR_BODY), stream=False)
    assert not reply.ok and reply.clear and reply.kind == "HTTP 503 no_healthy_workers"


async def test_error_status_without_the_body_is_unclear():
    reply = await _ask(httpx.Response(502, text="<html>bad gateway</html>"), stream=True)
    assert not reply.ok and not reply.clear and reply.kind == "HTTP 502 without an error body"


async def test_stream_joins_deltas_until_done():
    reply = await _ask(httpx.Response(200, content=_sse(_delta(""), _delta("ab"), _delta("c"))), stream=True)
    assert reply.ok and reply.text == "abc" and reply.request_id == "chatcmpl-2"


async def test_stream_error_event_is_clear():
    reply = await _ask(httpx.Response(200, content=_sse(_delta("ab"), ERROR_BODY)), stream=True)
    assert not reply.ok and reply.clear and reply.kind == "stream error no_healthy_workers"


async def test_stream_cut_without_done_is_unclear():
    reply = await _ask(httpx.Response(200, content=_sse(_delta("ab"), done=False)), stream=True)
    assert not reply.ok and not reply.clear and reply.kind == "stream cut"


@pytest.mark.parametrize("stream", [False, True])
async def test_connection_errors_are_unclear(stream):
    reply = await _ask(httpx.ConnectError("refused"), stream=stream)
    assert not reply.ok and not reply.clear and reply.kind == "ConnectError"
