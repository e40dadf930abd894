"""The fault-free answers every later answer is compared with, collected on the deployment under test
before any fault (greedy decoding is deterministic, so one answer per prompt is the answer).

Each prompt is asked twice, whole and streamed, and the two must agree: if they do not, exact-match
judging would be meaningless and the run stops. A just-started gateway may refuse requests for a
moment after /health says 200 (issue 8, finding 6); such refusals are retried for a bounded time and
counted, so the report can show them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from tools.chaos.client import TIMEOUT, Reply, chat

_RETRY_FOR_S = 60.0


class NoReferenceAnswer(RuntimeError):
    """No usable fault-free answer: a prompt kept failing, or its streamed and whole answers differ."""


@dataclass(frozen=True)
class Reference:
    """`texts[i]` answers `prompts[i]`; `refused_after_healthy` counts requests refused meanwhile."""

    texts: list[str]
    refused_after_healthy: int


async def _until_answered(http: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                          stream: bool) -> tuple[Reply, int]:
    deadline = time.monotonic() + _RETRY_FOR_S
    refused = 0
    while True:
        reply = await asyncio.wait_for(chat(http, url, model, prompt, max_tokens, stream=stream),
                                       _RETRY_FOR_S)
        if reply.ok or time.monotonic() > deadline:
            return reply, refused
        refused += 1
        await asyncio.sleep(0.2)


async def collect_reference(url: str, model: str, prompts: Sequence[str], max_tokens: int) -> Reference:
    texts, refused = [], 0
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        for index, prompt in enumerate(prompts):
            whole, refused_whole = await _until_answered(http, url, model, prompt, max_tokens, False)
            streamed, refused_streamed = await _until_answered(http, url, model, prompt, max_tokens, True)
            refused += refused_whole + refused_streamed
            for reply in (whole, streamed):
                if not reply.ok:
                    raise NoReferenceAnswer(f"prompt {index} got no fault-free answer: "
                                            f"{reply.kind} {reply.error}")
            if whole.text != streamed.text:
                raise NoReferenceAnswer(f"prompt {index}: whole and streamed greedy answers differ: "
                                      f"{whole.text!r} vs {streamed.text!r}")
            texts.append(whole.text)
    return Reference(texts, refused)
