"""Knowing that a one-sided write has landed in this worker's pages.

A transfer engine's "write done" tells the sender it is finished with the write; whether the
bytes are already in the receiver's memory is the engine's business and differs between engines,
transports and versions (Mooncake's TCP transport, as its source reads, completes a write once
the sender's socket took it, and the receiver's transfer thread copies it into the pool later).
Bytes that land after decode reused their pages would corrupt another request's KV silently. The
receiver can see arrival itself, with no help from the engine: prefill checksums each page right
before writing it (xxh3, services/prefill/room.py), and once decode's copy of a page hashes to the
same value the page holds exactly what was sent, so nothing still in flight can change it.
That holds only if the page could not match before the write: decode poisons the pages it offers
a one-sided writer (KVPool.poison), since a page reused for the same prompt can already hold the
very bytes on their way.

`wait_landed` polls that, bounded: on success before the request joins the batch, and after an
aborted request before its pages are freed (with the checksums of the writes prefill issued).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from libkv.checksums import checksums_in_parts
from libkv.pool import KVPool

# Bytes a sender has handed to its socket arrive within milliseconds unless this host is starved;
# past this bound a page that still differs was damaged (or its write failed midway), not late.
LANDING_TIMEOUT_S = 10.0
_FIRST_POLL_S = 0.001
_MAX_POLL_S = 0.05


async def wait_landed(pool: KVPool, pages: Sequence[int], sent: Sequence[int],
                      timeout_s: float = LANDING_TIMEOUT_S, sender_tp_size: int = 1) -> list[int]:
    """Wait until every page in `pages` hashes to its checksum in `sent`; return the pages that
    still differ after `timeout_s` (empty: everything landed). `sender_tp_size`: the prefill's
    tensor-parallel size, which decides how a page's checksum splits the KV heads."""
    pages, sent = list(pages), list(sent)
    deadline = time.monotonic() + timeout_s
    delay = _FIRST_POLL_S
    while True:
        arrived = await asyncio.to_thread(checksums_in_parts, pool, pages, sender_tp_size)
        pending = [(page, want) for page, want, got in zip(pages, sent, arrived, strict=True) if want != got]
        if not pending or time.monotonic() >= deadline:
            return [page for page, _ in pending]
        pages, sent = [page for page, _ in pending], [want for _, want in pending]
        await asyncio.sleep(delay)
        delay = min(delay * 2, _MAX_POLL_S)
