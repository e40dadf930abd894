"""One prefill request's transfer bookkeeping, shared by the event loop and the engine thread."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from libkv.transfer import PeerId, TransferBackend, TransferHandle
from services.prefill.transfer_queues import TransferQueues


@dataclass(eq=False)
class PrefillRoom:
    """The writes of one room: which prompt pages were pushed, and the writes still to await.

    The engine thread calls `push` after every chunk (pages fully computed so far); the write is
    issued on the room's transfer queue, carrying decode's grant for the room. With
    `want_checksums`, each page is checksummed (xxh3) right before its write: a pushed page is
    final, so decode can compare what arrived with what was sent. The servicer awaits `wait_all`
    after the prompt and calls `abort_all` on any failure. `closed` stops new writes the moment an
    abort starts, so nothing is written after Abort has been answered.

    The first `skip_pages` pages of the prompt are never written (decode holds them already):
    prompt page `skip_pages + i` goes to `dst_page_ids[i]`, and checksums cover written pages only.
    """

    room: str
    backend: TransferBackend
    queues: TransferQueues
    dst_page_ids: list[int]
    grant: bytes = b""
    want_checksums: bool = False
    checksums: list[int] = field(default_factory=list)  # in dst_page_ids order, filled by the writes
    peer: PeerId | None = None  # set once the handshake with decode's endpoint is done
    task: asyncio.Task | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    writes: list[Future[TransferHandle]] = field(default_factory=list)
    skip_pages: int = 0
    pages_pushed: int = 0  # pages written (issued), after the skipped ones
    bytes_pushed: int = 0
    first_write_at: float | None = None
    closed: bool = False
    cleaning: bool = False  # the servicer is stopping and freeing the room (an Abort only waits)
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
        sums = self.backend.page_checksums_for(self.peer, src) if self.want_checksums else []
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
