"""StoreTier: a worker's side of the cluster-wide KV store (see libkv/store/__init__.py).

Two calls from the engine thread, neither of which waits on the store for long:
- `offer(...)` when full pages enter the local prefix cache: the pages are retained (so nobody
  reuses them before their bytes are copied) and queued for the writer thread, which copies the
  bytes out, releases the pages and puts them. The queue is bounded (in pages); a page that does
  not fit is dropped and counted, never waited for.
  An entry that failed its check on a fetch is overwritten by the next copy of that page
  computed here (Mooncake's put keeps an existing value; upsert replaces it).
- `fetch(...)` at admission, after the local match: which of the next leading pages the store
  holds (one exists call), then their values (one get), checked (entry.check), written into pages
  the caller allocates, 32 pages per call. It runs synchronously on the engine thread, each store
  call bounded by the client's timeout (--hicache-timeout, 0.5 s): measured on this 2-core host, 40
  pages of 64 KiB from a master on 127.0.0.1 took 6.9 ms per fetch (mean of 10), against about 90 ms
  to compute those 640 tokens of the tiny model; a slow store delays one admission by the timeout
  at most, once, and is then down.

Watchers (the worker's KV events, services/worker/kv_events.py): `watch(listener)` returns the
page hashes this tier knows the store holds (written or fetched by it, the most recent 65,536) and
then calls `listener("stored" | "removed", hashes)` on every change, under the tier's lock (so the
listener only records). A restarted master starts empty, so the store going down removes them all.

The store down: any failed call marks the tier down (one log line, `up` False); while down nothing
is offered or fetched and requests are computed as without the store. A probe thread connects the
client at start (never on the caller's thread: a store that is not there only means computing
without it) and, while down, pings the store every `probe_interval_s` until it answers.
"""

from __future__ import annotations

import bisect
import logging
import queue
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from libkv.pool import KVPool
from libkv.store import entry
from libkv.store.client import StoreClient, StoreError
from pdserve.page_hash import ROOT_HASH

log = logging.getLogger("pdserve.hicache")

FETCH_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_MAX_BATCH = 32  # pages per store call (keeps a batch within the client's staging buffer)
_WRITTEN_MEMORY = 1 << 16  # page hashes remembered as already in the store (not offered again)


@dataclass
class StoreStats:
    """Running totals (never reset), read by the worker's metrics at scrape time. `fetch_buckets[i]`
    counts fetches of at most FETCH_BUCKETS[i] seconds (and above them all, the last)."""

    BOUNDS: ClassVar[tuple[float, ...]] = FETCH_BUCKETS

    hit_pages: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    pages_written: int = 0
    dropped_pages: int = 0  # offered but not written: the write queue was full, or the store went down
    errors: int = 0
    corrupt: int = 0
    fetch_buckets: list[int] = field(default_factory=lambda: [0] * (len(FETCH_BUCKETS) + 1))
    fetch_count: int = 0
    fetch_seconds: float = 0.0

    def observe_fetch(self, seconds: float) -> None:
        self.fetch_buckets[bisect.bisect_left(FETCH_BUCKETS, seconds)] += 1
        self.fetch_count += 1
        self.fetch_seconds += seconds


@dataclass(frozen=True)
class _Write:
    page: int
    page_hash: int
    tokens_digest: int


class StoreTier:
    """Write-through and fetch-on-miss of full KV pages (module docstring). `retain(pages)` and
    `release(pages)` are the page manager's (thread-safe): queued pages stay out of reuse."""

    def __init__(self, client: StoreClient, pool: KVPool, identity: entry.StoreIdentity,
                 retain: Callable[[list[int]], None], release: Callable[[list[int]], None],
                 write_queue_pages: int = 256, probe_interval_s: float = 1.0) -> None:
        self.client = client
        self.pool = pool
        self.identity = identity
        self.page_nbytes = pool.layout.page_nbytes
        self._retain, self._release = retain, release
        self.stats = StoreStats()
        self.probe_interval_s = probe_interval_s
        self._up = False
        self._queue: queue.Queue[_Write | None] = queue.Queue(maxsize=write_queue_pages)
        self._written: OrderedDict[int, None] = OrderedDict()
        self._repair: set[int] = set()  # page hashes whose stored entry failed its check: overwrite them
        self._written_lock = threading.Lock()
        self._watchers: list[Callable[[str, list[int]], None]] = []  # called under _written_lock
        self._stopping = threading.Event()
        self._wake_probe = threading.Event()
        self._writer = threading.Thread(target=self._write_loop, name="hicache-writer", daemon=True)
        self._prober = threading.Thread(target=self._probe_loop, name="hicache-probe", daemon=True)

    def start(self) -> StoreTier:
        self._writer.start()
        self._prober.start()
        return self

    @property
    def up(self) -> bool:
        return self._up

    @property
    def location(self) -> str:
        """Which store and key namespace the pages are in: workers with the same location share them."""
        return f"{getattr(self.client, 'master', 'store')}/{self.identity.prefix}"

    def watch(self, listener: Callable[[str, list[int]], None]) -> list[int]:
        """Register `listener` (module docstring) and return the page hashes known to be in the store now."""
        with self._written_lock:
            self._watchers.append(listener)
            return list(self._written)

    def unwatch(self, listener: Callable[[str, list[int]], None]) -> None:
        with self._written_lock:
            if listener in self._watchers:
                self._watchers.remove(listener)

    @property
    def repairs_pending(self) -> int:
        """Pages whose stored entry failed its check and has not been overwritten yet."""
        with self._written_lock:
            return len(self._repair)

    # ---- engine thread --------------------------------------------------------------------------
    def offer(self, token_ids: Sequence[int], page_ids: Sequence[int], hashes: Sequence[int],
              first: int) -> None:
        """Queue pages `first`..len(hashes) of a sequence (full, computed, just cached) for writing."""
        if not self._up:
            return
        size = self.pool.layout.page_size
        with self._written_lock:
            todo = [i for i in range(first, len(hashes)) if hashes[i] not in self._written]
        for n, index in enumerate(todo):
            parent = hashes[index - 1] if index else ROOT_HASH
            write = _Write(page_ids[index], hashes[index],
                           entry.tokens_hash(parent, token_ids[index * size:(index + 1) * size]))
            self._retain([write.page])
            try:
                self._queue.put_nowait(write)
            except queue.Full:
                self._release([write.page])
                self.stats.dropped_pages += len(todo) - n
                return

    def fetch(self, token_ids: Sequence[int], hashes: Sequence[int], first: int, last: int,
              allocate: Callable[[int], list[int] | None]) -> list[int]:
        """Pages holding the store's longest run of the sequence's pages `first`..`last`-1 (after
        the `first` found locally), checked and written into pages from `allocate(n)` (owned by
        the caller; None: no room, nothing fetched). Empty when the store has none or is down."""
        if not self._up or first >= last:
            return []
        started = time.perf_counter()
        values: list[bytes] = []
        try:
            for start in range(first, last, _MAX_BATCH):  # stops at the first page the store lacks
                batch = self._fetch_values(hashes, start, min(last, start + _MAX_BATCH))
                values += batch
                if len(batch) < min(last, start + _MAX_BATCH) - start:
                    break
        except StoreError as exc:
            self._down(exc)
            return []
        size = self.pool.layout.page_size
        good: list[bytes] = []
        for offset, value in enumerate(values):
            index = first + offset
            parent = hashes[index - 1] if index else ROOT_HASH
            digest = entry.tokens_hash(parent, token_ids[index * size:(index + 1) * size])
            if not entry.check(value, hashes[index], digest, self.page_nbytes):
                if value:  # b"": evicted between the exists check and the get
                    self.stats.corrupt += 1
                    with self._written_lock:
                        self._repair.add(hashes[index])
                    log.warning("hicache: store entry %s failed its check (corrupt or foreign); computing it",
                                self.identity.key(hashes[index]))
                break
            good.append(value)
        pages = allocate(len(good)) if good else None
        if not pages:
            return []
        self._write_pages(pages, good)
        with self._written_lock:
            self._remember(hashes[first:first + len(good)])
        self.stats.hit_pages += len(good)
        self.stats.bytes_read += len(good) * self.page_nbytes
        self.stats.observe_fetch(time.perf_counter() - started)
        return pages

    def _fetch_values(self, hashes: Sequence[int], first: int, last: int) -> list[bytes]:
        keys = [self.identity.key(h) for h in hashes[first:last]]
        present = self.client.exists(keys)
        run = next((i for i, there in enumerate(present) if not there), len(present))
        return self.client.get(keys[:run]) if run else []

    def _write_pages(self, pages: list[int], values: list[bytes]) -> None:
        flat = self.pool.buffer.view(self.pool.num_pages, -1).view(torch.uint8)
        with warnings.catch_warnings():  # a read-only numpy view of the bytes: copied from, never written
            warnings.simplefilter("ignore", UserWarning)
            for page, value in zip(pages, values, strict=True):
                src = torch.from_numpy(np.frombuffer(value, dtype=np.uint8, offset=entry.HEADER_NBYTES))
                flat[page].copy_(src)

    # ---- writer and probe threads ---------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < _MAX_BATCH:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)  # stop after this batch
                    break
                batch.append(more)
            self._write_batch(batch)

    def _write_batch(self, batch: list[_Write]) -> None:
        pages = [w.page for w in batch]
        try:
            gathered = self.pool.buffer[torch.tensor(pages, dtype=torch.long, device=self.pool.device)]
            data = gathered.view(len(pages), -1).view(torch.uint8).cpu().numpy()
        finally:
            self._release(pages)
        if not self._up or self._stopping.is_set():
            self.stats.dropped_pages += len(batch)
            return
        values = [entry.encode(w.page_hash, w.tokens_digest, data[i].data) for i, w in enumerate(batch)]
        keys = [self.identity.key(w.page_hash) for w in batch]
        with self._written_lock:
            repair = [i for i, w in enumerate(batch) if w.page_hash in self._repair]
        try:
            self.client.put(keys, values)  # leaves an existing key's value as it is
            if repair:  # the page this worker just computed replaces the entry that failed its check
                self.client.upsert([keys[i] for i in repair], [values[i] for i in repair])
                with self._written_lock:
                    self._repair.difference_update(batch[i].page_hash for i in repair)
        except StoreError as exc:
            self.stats.dropped_pages += len(batch)
            self._down(exc)
            return
        with self._written_lock:
            self._remember([w.page_hash for w in batch])
        self.stats.pages_written += len(batch)
        self.stats.bytes_written += len(batch) * self.page_nbytes

    def _remember(self, page_hashes: Sequence[int]) -> None:
        """Note pages as in the store (most recent last; the oldest beyond the memory are forgotten)
        and tell the watchers. Called under _written_lock."""
        new = [h for h in page_hashes if h not in self._written]
        for page_hash in page_hashes:
            self._written[page_hash] = None
            self._written.move_to_end(page_hash)
        forgotten = []
        while len(self._written) > _WRITTEN_MEMORY:
            forgotten.append(self._written.popitem(last=False)[0])
        self._notify("stored", new)
        self._notify("removed", forgotten)

    def _notify(self, kind: str, page_hashes: list[int]) -> None:
        if page_hashes:
            for listener in self._watchers:
                listener(kind, page_hashes)

    def _down(self, why: Exception) -> None:
        self.stats.errors += 1
        if self._up:
            self._up = False
            # What was written may be gone (a restarted master starts empty): offer pages again.
            with self._written_lock:
                self._notify("removed", list(self._written))
                self._written.clear()
            log.warning("hicache: store down (%s); computing without it until it answers again", why)
            self._wake_probe.set()

    def _probe_loop(self) -> None:
        while not self._stopping.is_set():
            if not self._up:
                try:
                    if not getattr(self.client, "connected", True):
                        self.client.connect()
                    self.client.ping()
                except Exception as exc:  # StoreError, or the client failed to load at all
                    self.stats.errors += 1
                    log.debug("hicache: store probe failed: %s", exc)
                else:
                    if not self._stopping.is_set():
                        self._up = True
                        log.info("hicache: store up (%s)", getattr(self.client, "master", "store"))
            self._wake_probe.wait(self.probe_interval_s)
            self._wake_probe.clear()

    def close(self, *, exiting: bool = False) -> None:
        """Stop both threads (queued pages are released unwritten) and close the client (`exiting`:
        the process ends right after; see MooncakeStoreClient.close)."""
        self._stopping.set()
        self._up = False
        self._wake_probe.set()
        while True:  # release what is still queued
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self._release([item.page])
        self._queue.put(None)
        self._writer.join(timeout=5)
        self.client.close(exiting=exiting)
