"""One prefill request's transfer bookkeeping, shared by the event loop and the engine thread."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

from libkv.transfer import PeerId, TransferBackend, TransferHandle


@dataclass(eq=False)
class PrefillRoom:
    """The writes of one room: which prompt pages were pushed, and the handles still to await.

    The engine thread calls `push` after every chunk (pages fully computed so far); the servicer
    awaits `wait_all` after the prompt and calls `abort_all` on any failure. `closed` stops new
    writes the moment an abort starts, so nothing is written after Abort has been answered.
    """

    room: str
    backend: TransferBackend
    dst_page_ids: list[int]
    peer: PeerId | None = None  # set once the handshake with decode's endpoint is done
    task: asyncio.Task | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    handles: list[TransferHandle] = field(default_factory=list)
    pages_pushed: int = 0
    bytes_pushed: int = 0
    first_write_at: float | None = None
    closed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def push(self, page_ids: list[int], num_tokens: int) -> None:
        """Write the pages in `page_ids` not written yet (called from the engine thread)."""
        with self._lock:
            if self.closed:
                return
            new = page_ids[self.pages_pushed:]
            if not new:
                return
            start = self.pages_pushed
            handle = self.backend.write(self.peer, new, self.dst_page_ids[start:start + len(new)],
                                        key=self.room)
            self.first_write_at = self.first_write_at or time.perf_counter()
            self.handles.append(handle)
            self.pages_pushed += len(new)
            self.bytes_pushed += handle.nbytes

    async def wait_all(self) -> None:
        """Until every write has landed in decode's memory; raises TransferError otherwise."""
        index = 0
        while True:
            with self._lock:
                if index >= len(self.handles):
                    return
                handle = self.handles[index]
            await self.backend.wait(handle)
            index += 1

    def abort_all(self) -> None:
        """Stop writing; returns once no write of this room can still land (blocking: run in a thread)."""
        with self._lock:
            self.closed = True
            handles = list(self.handles)
        for handle in handles:
            self.backend.abort(handle)
