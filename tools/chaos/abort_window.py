"""Clients that leave around the first token: the abort lands when prefill has just finished and decode
is landing the KV or taking the request into its batch (the window of issue 24's "an abort after
prefill finished and before decode admitted the room").

The first token's time is learnt as the run goes (the median of the last streams' time to first
event), and each request is cut in one of two ways, in turn:
- `at-first-token`: closed the moment its first event arrives (decode has just admitted it);
- `near-first-token`: closed after 0.5-1.1 times the median time to first token (mostly while the KV
  lands or the request waits for admission; some finish prefill later and are cut earlier).
A request that finished before its cut is counted as `MODE completed`. The deterministic version
of this fault, with the abort placed in the window by a hook, is tests/e2e/test_abort_window.py.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections import Counter, deque
from collections.abc import Sequence

import httpx

from tools.chaos.client import TIMEOUT, chat_body
from tools.chaos.disconnects import cut_after

MODES = ("at-first-token", "near-first-token")
_FIRST_GUESS_S = 0.2  # until a stream has told how long the first token takes


async def _first_event(http: httpx.AsyncClient, url: str, body: dict) -> float | None:
    """Stream the request and leave at its first data event; seconds to it, None if none came."""
    started = time.monotonic()
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                return time.monotonic() - started  # leaving the block drops the connection
    return None


async def abort_around_first_token(url: str, model: str, prompts: Sequence[str], *, count: int,
                                   max_tokens: int, seed: int, concurrency: int = 4) -> Counter:
    """`count` streaming requests cut around their first token, `concurrency` at a time. Returns
    counts by MODE (cut), `MODE completed` and `errors`."""
    rng = random.Random(seed)
    ttfts: deque[float] = deque(maxlen=16)
    limit = asyncio.Semaphore(concurrency)
    counts: Counter = Counter()

    async def run(i: int, prompt: str, fraction: float) -> None:
        mode = MODES[i % len(MODES)]
        body = chat_body(model, prompt, max_tokens, stream=True)
        async with limit, httpx.AsyncClient(timeout=TIMEOUT) as http:
            try:
                if mode == "at-first-token":
                    ttft = await _first_event(http, url, body)
                    if ttft is not None:
                        ttfts.append(ttft)
                    counts[mode if ttft is not None else f"{mode} completed"] += 1
                    return
                guess = statistics.median(ttfts) if ttfts else _FIRST_GUESS_S
                cut = await cut_after(fraction * guess, _first_event(http, url, body))
            except httpx.HTTPError:
                counts["errors"] += 1
                return
        counts[mode if cut else f"{mode} completed"] += 1

    await asyncio.gather(*(run(i, prompts[rng.randrange(len(prompts))], rng.uniform(0.5, 1.1))
                           for i in range(count)))
    return counts
