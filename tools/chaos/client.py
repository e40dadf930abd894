"""One greedy chat completion through the gateway, as an HTTP client sees it.

`chat` returns a `Reply`: the generated text when the answer was complete (HTTP 200 and, when
streaming, the `[DONE]` event), or why it failed and whether the failure was **clear**: an HTTP error
status with an OpenAI-style error body (`{"error": {"message": ...}}`), or a stream that ended with
an error event. Anything else (connection refused or reset, a stream cut without an error event, an
error status without that body) is an unclear failure. Nothing here times out on reading: the load
generator decides when a request is hung and cancels it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx

# Connecting is bounded (a dead gateway refuses at once; this only guards odd network states);
# reading is not: the caller's hung bound applies.
TIMEOUT = httpx.Timeout(None, connect=10.0)


@dataclass(frozen=True)
class Reply:
    """A finished request: `text` when it completed, else `error` (`kind` is its short, stable
    category, for counting) and whether it was `clear`."""

    text: str | None = None
    kind: str = ""
    error: str = ""
    clear: bool = False
    status: int = 0
    request_id: str = ""  # the gateway's response id (chatcmpl-...): the room in every worker's log

    @property
    def ok(self) -> bool:
        return self.text is not None


def chat_body(model: str, prompt: str, max_tokens: int, *, stream: bool) -> dict[str, Any]:
    """A greedy request that always generates `max_tokens` tokens (ignore_eos), so every answer has
    the same length and streams have a middle to be cut in."""
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}


def error_of(payload: Any) -> tuple[str, str] | None:
    """(code or type, message) of an OpenAI-style error body, or None if `payload` is not one."""
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        message = payload["error"].get("message")
        if isinstance(message, str):
            return str(payload["error"].get("code") or payload["error"].get("type") or "error"), message
    return None


def _failed_status(status: int, raw: bytes) -> Reply:
    try:
        error = error_of(json.loads(raw))
    except ValueError:
        error = None
    if error is not None:
        return Reply(kind=f"HTTP {status} {error[0]}", error=error[1][:200], clear=True, status=status)
    return Reply(kind=f"HTTP {status} without an error body", error=repr(raw[:120]), status=status)


async def chat(http: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int, *,
               stream: bool) -> Reply:
    """POST /v1/chat/completions and read the whole answer."""
    body = chat_body(model, prompt, max_tokens, stream=stream)
    try:
        if not stream:
            response = await http.post(f"{url}/v1/chat/completions", json=body)
            if response.status_code != 200:
                return _failed_status(response.status_code, response.content)
            try:
                payload = response.json()
                return Reply(text=payload["choices"][0]["message"]["content"] or "", status=200,
                             request_id=str(payload.get("id", "")))
            except (ValueError, KeyError, IndexError, TypeError):
                return Reply(kind="HTTP 200 malformed body", error=repr(response.content[:120]), status=200)
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return _failed_status(response.status_code, await response.aread())
            return await _read_stream(response)
    except httpx.HTTPError as exc:
        return Reply(kind=type(exc).__name__, error=str(exc)[:200])


async def _read_stream(response: httpx.Response) -> Reply:
    parts: list[str] = []
    request_id = ""
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            return Reply(text="".join(parts), status=200, request_id=request_id)
        try:
            event = json.loads(data)
        except ValueError:
            return Reply(kind="stream event not JSON", error=repr(data[:120]), status=200)
        error = error_of(event)
        if error is not None:
            return Reply(kind=f"stream error {error[0]}", error=error[1][:200], clear=True, status=200)
        request_id = request_id or str(event.get("id", ""))
        for choice in event.get("choices", []):
            parts.append((choice.get("delta") or {}).get("content") or "")
    return Reply(kind="stream cut", error="stream ended without [DONE] or an error event", status=200)
