"""Clients that go away at random points, to check that an abort frees everything it held.

Three ways to leave, in turn:
- `before-first-token`: a streaming request closed 0-80 ms after sending (the gateway starts the
  response only with the first token, so most are cut during prefill or KV transfer);
- `mid-stream`: a streaming request closed after 1 to max_tokens-1 events;
- `whole`: a non-streaming request closed 5-600 ms after sending (prefill, transfer or decode).
Each uses its own connection, so closing it closes the TCP connection the gateway watches. A request
that finished before its cut point is counted as `completed`, not as a disconnect. Long answers
(`max_tokens`) keep requests alive long enough to be cut in the middle.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Sequence

import httpx

from tools.chaos.client import TIMEOUT, chat_body

MODES = ("before-first-token", "mid-stream", "whole")


async def cut_after(delay_s: float, request) -> bool:
    """Run `request` but drop it after `delay_s`; True if it was cut, False if it finished first."""
    try:
        await asyncio.wait_for(request, delay_s)
        return False
    except TimeoutError:
        return True


async def _one(url: str, body: dict, mode: str, rng: random.Random) -> bool:
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        if mode == "whole":
            return await cut_after(rng.uniform(0.002, 0.6),
                                   http.post(f"{url}/v1/chat/completions", json=body))
        if mode == "before-first-token":
            async def open_stream() -> None:
                async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                    await response.aread()
            return await cut_after(rng.uniform(0.002, 0.15), open_stream())
        events_before_cut = rng.randint(1, max(1, body["max_tokens"] - 1))
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            seen = 0
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen >= events_before_cut:
                        return True  # leaving the block closes the unread response: the connection drops
        return False


async def disconnect_clients(url: str, model: str, prompts: Sequence[str], *, count: int, max_tokens: int,
                             seed: int, concurrency: int = 4) -> Counter:
    """`count` requests, each dropped at a random point, `concurrency` at a time. Returns counts by
    `MODE` (cut) and `MODE completed` (finished before its cut point) and `errors`."""
    rng = random.Random(seed)
    plans = [(MODES[i % len(MODES)], rng.randrange(len(prompts)), random.Random(rng.random()))
             for i in range(count)]
    limit = asyncio.Semaphore(concurrency)
    counts: Counter = Counter()

    async def run(mode: str, prompt_index: int, own_rng: random.Random) -> None:
        body = chat_body(model, prompts[prompt_index], max_tokens, stream=mode != "whole")
        async with limit:
            try:
                cut = await _one(url, body, mode, own_rng)
            except httpx.HTTPError:
                counts["errors"] += 1
                return
        counts[mode if cut else f"{mode} completed"] += 1

    await asyncio.gather(*(run(*plan) for plan in plans))
    return counts
