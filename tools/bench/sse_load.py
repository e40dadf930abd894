"""A lean streaming-chat load generator for fleet-rate benchmarks: raw HTTP/1.1 over asyncio streams,
one connection per request, no JSON parsing but the last event's usage, so the client's own CPU stays
small beside the gateway it measures.

`run_load(urls, ...)` sends `num_requests` streamed chat completions (ignore_eos, a fixed number of
output tokens) at `concurrency` at a time, or at a target request rate, spread over the gateway URLs
round-robin, and returns each request's timings: time to the first content event, the last event, the
output tokens (from the usage event) and any error.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass
class StreamTiming:
    """One streamed request as the client saw it."""

    start: float
    first: float | None = None  # first data event
    end: float | None = None  # the [DONE] event
    tokens: int = 0  # completion tokens, from the usage event
    events: int = 0  # data events with content (several tokens each under --stream-interval)
    error: str | None = None
    event_times: list[float] = field(default_factory=list)  # arrival of each data event

    @property
    def gaps(self) -> list[float]:
        """Seconds between consecutive data events (the inter-token gaps at stream interval 1)."""
        return [b - a for a, b in zip(self.event_times, self.event_times[1:], strict=False)]

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.start

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first one."""
        if self.first is None or self.end is None or self.tokens < 2:
            return None
        return (self.end - self.first) / (self.tokens - 1)


def chat_body(model: str, prompt: str, max_tokens: int) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()


async def stream_one(url: str, body: bytes, timeout_s: float = 300.0) -> StreamTiming:
    """POST `body` to URL's /v1/chat/completions and read the SSE stream to its end."""
    parts = urlsplit(url)
    timing = StreamTiming(start=time.perf_counter())
    writer = None
    try:
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                     % (parts.netloc.encode(), len(body), body))
        await writer.drain()
        await asyncio.wait_for(_read(reader, timing), timeout_s)
    except (OSError, asyncio.TimeoutError, ValueError) as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
    finally:
        if writer is not None:
            writer.close()
    return timing


async def _read(reader: asyncio.StreamReader, timing: StreamTiming) -> None:
    status = await reader.readline()
    if b" 200 " not in status:
        rest = await reader.read(2000)
        raise ValueError(f"{status.decode().strip()} {rest[-300:].decode(errors='replace')}")
    last_data = b""
    async for line in reader:  # chunked framing lines are skipped: only "data: ..." lines count
        if not line.startswith(b"data: "):
            continue
        if line.startswith(b"data: [DONE]"):
            timing.end = time.perf_counter()
            break
        now = time.perf_counter()
        if timing.first is None:
            timing.first = now
        timing.events += 1
        timing.event_times.append(now)
        last_data = line
    if timing.end is None:
        raise ValueError("the stream ended without [DONE]")
    usage = json.loads(last_data[6:]).get("usage") or {}
    if "error" in json.loads(last_data[6:]):
        raise ValueError(last_data[6:300].decode())
    timing.tokens = int(usage.get("completion_tokens", 0))


async def run_load(urls: list[str], body: bytes, num_requests: int, *, concurrency: int,
                   rate: float | None = None) -> list[StreamTiming]:
    """`num_requests` streams over `urls` round-robin, at most `concurrency` at once; with `rate`,
    started at that many requests per second (Poisson arrivals are not needed to load a gateway:
    evenly spaced)."""
    gate = asyncio.Semaphore(concurrency)
    targets = itertools.cycle(urls)

    async def one(url: str) -> StreamTiming:
        async with gate:
            return await stream_one(url, body)

    tasks = []
    began = time.perf_counter()
    for i in range(num_requests):
        if rate:
            delay = began + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(next(targets))))
    return list(await asyncio.gather(*tasks))
