"""The prefill's KV writes into decode's pages: each room's writes, and the transfer queues that
issue them off the engine thread.

Transfer queues mirror SGLang's knobs: PDSERVE_DISAGGREGATION_QUEUE_SIZE queues share
PDSERVE_DISAGGREGATION_THREAD_POOL_SIZE threads; a room always uses the same queue, so its writes
are issued in order while requests of other rooms (and other decode peers) proceed in parallel.
The engine thread only enqueues, so a slow transfer-engine call never stalls the forward loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from libkv.transfer import PeerId, TransferBackend, TransferHandle

T = TypeVar("T")


class TransferQueues:
    """`num_queues` executors with `thread_pool_size` threads between them (at least one each)."""

    def __init__(self, num_queues: int, thread_pool_size: int) -> None:
        if num_queues < 1 or thread_pool_size < 1:
            raise ValueError("transfer queues need >= 1 queue and thread, "
                             f"got {num_queues} and {thread_pool_size}")
        per_queue = max(1, thread_pool_size // num_queues)
        self._queues = [ThreadPoolExecutor(per_queue, thread_name_prefix=f"pdserve-transfer-{i}")
                        for i in range(num_queues)]

    def submit(self, room: str, fn: Callable[[], T]) -> Future[T]:
        # crc32, not hash(): stable across processes, so logs and tests can predict the queue.
        return self._queues[zlib.crc32(room.encode()) % len(self._queues)].submit(fn)

    def shutdown(self) -> None:
        for queue in self._queues:
            queue.shutdown(wait=True, cancel_futures=True)


@dataclass(eq=False)
class RoomWrites:
    """The writes of one room: which prompt pages were pushed, and the writes still to await.
    Shared by the event loop and the engine thread.

    The engine thread calls `push` after every chunk (pages fully computed so far: the prefill-only
    request's `on_pages_filled`); the write is issued on the room's transfer queue, carrying
    decode's grant for the room. With `want_checksums`, each page is checksummed (xxh3) right
    before its write: a pushed page is final, so decode can compare what arrived with what was sent.
    The servicer awaits `wait_all` after the prompt and calls `abort_all` on any failure. `closed`
    stops new writes the moment an abort starts, so nothing is written after Abort has been answered.

    The first `skip_pages` pages of the prompt are never written (decode holds them already):
    prompt page `skip_pages + i` goes to `dst_page_ids[i]`, and checksums cover written pages only.
    """

    room: str
    backend: TransferBackend
    queues: TransferQueues
    peer: PeerId  # decode's transfer endpoint, connected (the handshake)
    dst_page_ids: list[int]
    grant: bytes = b""
    want_checksums: bool = False
    checksums: list[int] = field(default_factory=list)  # in dst_page_ids order, filled by the writes
    writes: list[Future[TransferHandle]] = field(default_factory=list)
    skip_pages: int = 0
    pages_pushed: int = 0  # pages written (issued), after the skipped ones
    bytes_pushed: int = 0
    first_write_at: float | None = None
    closed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def push(self, page_ids: list[int], num_tokens: int) -> None:
        """Queue a write of the pages in `page_ids` not written yet (called from the engine thread)."""
        with self._lock:
            if self.closed:
                return
            start = self.skip_pages + self.pages_pushed
            new = page_ids[start:]
            if not new:
                return
            dst = self.dst_page_ids[self.pages_pushed:self.pages_pushed + len(new)]
            self.first_write_at = self.first_write_at or time.perf_counter()
            self.writes.append(self.queues.submit(self.room, lambda: self._issue(new, dst)))
            self.pages_pushed += len(new)

    def _issue(self, src: list[int], dst: list[int]) -> TransferHandle:
        sums = self.backend.page_checksums_for(self.peer, src, key=self.room) if self.want_checksums else []
        handle = self.backend.write(self.peer, src, dst, key=self.room, grant=self.grant)
        with self._lock:  # one room's writes run in push order on its queue
            self.checksums.extend(sums)  # only for issued writes: decode waits for these to land
            self.bytes_pushed += handle.nbytes
        return handle

    async def wait_all(self) -> None:
        """Until every write has landed in decode's memory; raises TransferError otherwise."""
        index = 0
        while True:
            with self._lock:
                if index >= len(self.writes):
                    return
                write = self.writes[index]
            await self.backend.wait(await asyncio.wrap_future(write))
            index += 1

    def abort_all(self) -> None:
        """Stop writing; returns once no write of this room can still land (blocking: run in a thread)."""
        with self._lock:
            self.closed = True
            writes = list(self.writes)
        for write in writes:
            try:
                handle = write.result()  # issued or failed; a queued write runs (and is aborted) first
            except Exception:
                continue  # never issued: nothing to stop
            self.backend.abort(handle)
