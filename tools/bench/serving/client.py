"""One streamed request to an OpenAI-compatible server, timed as the client sees it.

Two endpoints: `/v1/completions` (the prompt as token ids or text) and `/v1/chat/completions`
(the prompt text as one user message). They differ only in the body and in where a stream chunk
says how many tokens it carries (`Endpoint`); `send` is the same for both. The request is greedy
with `ignore_eos` (unless disabled), so it generates exactly `output_len` tokens, and asks for
logprobs (`logprobs: 0`, or `logprobs: true` in chat): each stream chunk then lists the tokens it
carries. Events that arrive in one network read (or one chunk carrying k tokens) are one arrival
of k tokens, counted as k inter-token gaps of 1/k of its wait each (what SGLang's bench_serving
does with the token counts its own server reports). A server that sends no logprobs is counted
one token per chunk with text. `stream_options.include_usage` gives the prompt and completion
token counts the server itself measured (in chat, the prompt count includes the chat template).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from tools.bench.serving.datasets import Prompt


@dataclass
class RequestResult:
    """What one request measured. Times are seconds; `start` is on the runner's clock
    (time.perf_counter), `token_times` are absolute on the same clock, one per token."""

    request_class: str
    input_len: int
    output_len: int
    start: float = 0.0
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (None for a one-token answer)."""
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def completions_body(model: str, prompt: Prompt, *, ignore_eos: bool, logprobs: bool) -> dict:
    body = {"model": model, "prompt": prompt.prompt, "max_tokens": prompt.output_len, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    if logprobs:
        body["logprobs"] = 0
    return body


def chat_body(model: str, prompt: Prompt, *, ignore_eos: bool, logprobs: bool) -> dict:
    if not isinstance(prompt.prompt, str):
        raise ValueError("a chat request needs the prompt as text "
                         "(datasets.random_prompts(..., as_text=True))")
    body = {"model": model, "messages": [{"role": "user", "content": prompt.prompt}],
            "max_tokens": prompt.output_len, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    if logprobs:
        body["logprobs"] = True
    return body


def _completion_tokens(choice: dict) -> int:
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict) and isinstance(logprobs.get("tokens"), list):
        return len(logprobs["tokens"])
    return 1 if choice.get("text") else 0


def _chat_tokens(choice: dict) -> int:
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
        return len(logprobs["content"])
    delta = choice.get("delta")
    return 1 if isinstance(delta, dict) and delta.get("content") else 0


@dataclass(frozen=True)
class Endpoint:
    """Where requests go, the body sent there, and how many tokens one stream choice carries."""

    path: str
    body: Callable[..., dict]
    tokens_in: Callable[[dict], int]


ENDPOINTS = {"completions": Endpoint("/v1/completions", completions_body, _completion_tokens),
             "chat": Endpoint("/v1/chat/completions", chat_body, _chat_tokens)}


async def send(http: httpx.AsyncClient, url: str, model: str, prompt: Prompt, *, ignore_eos: bool = True,
               logprobs: bool = True, endpoint: str = "completions") -> RequestResult:
    """POST one streamed request to `endpoint` (a key of ENDPOINTS) and time every token. Never raises
    for a failed request: the result says what went wrong."""
    result = RequestResult(prompt.request_class, prompt.input_len, prompt.output_len)
    api = ENDPOINTS[endpoint]
    body = api.body(model, prompt, ignore_eos=ignore_eos, logprobs=logprobs)
    result.start = last = time.perf_counter()
    try:
        async with http.stream("POST", f"{url}{api.path}", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
                return result
            pending = ""
            async for text in response.aiter_text():
                # Every event that came in one read arrived at the same instant: their tokens are
                # one arrival, whose wait is split evenly over them (as over a chunk's tokens).
                now = time.perf_counter()
                pending += text
                *events, pending = pending.split("\n\n")
                tokens = 0
                for raw in events:
                    data = raw.strip().removeprefix("data:").strip()
                    if not data:
                        continue
                    if data == "[DONE]":
                        result.ok = True
                        continue
                    event = json.loads(data)
                    if "error" in event:
                        result.error = f"stream error: {str(event['error'])[:200]}"
                        return result
                    usage = event.get("usage") or {}
                    result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
                    result.output_tokens = usage.get("completion_tokens", result.output_tokens)
                    tokens += sum(api.tokens_in(choice) for choice in event.get("choices") or [])
                if tokens == 0:
                    continue
                if not result.token_times:
                    result.ttft = now - result.start
                    result.token_times.append(now)
                    tokens -= 1
                    last = now  # tokens that came with the first one were ready with it
                if tokens:
                    result.itl.extend([(now - last) / tokens] * tokens)
                    result.token_times.extend([now] * tokens)
                last = now
    except (httpx.HTTPError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {str(exc)[:200]}"
        return result
    result.latency = time.perf_counter() - result.start
    if not result.ok and not result.error:
        result.error = "the stream ended without [DONE]"
    if result.ok and not result.token_times:
        result.ok, result.error = False, "the stream carried no token"
    result.output_tokens = result.output_tokens or len(result.token_times)
    return result
