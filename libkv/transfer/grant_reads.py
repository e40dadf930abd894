"""verify_grant for one-sided engines: read a peer's grant-table entries and compare them.

The sender reads the entries of the destination pages from the receiver's registered grant
table (libkv.transfer.grants) into one of its own read slots, through the same engine and
endpoint its writes use, so a caller cannot point the check anywhere else. Pages are grouped
into spans (nearby pages read together) and spans into rounds that fit one slot: one engine
operation per round, so a prompt's pages cost one read. Comparison happens here, on the sender.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy

from libkv.transfer.grants import TAG_NBYTES, GrantTable, Refusal, compare_entries, rounds, spans
from libkv.transfer.state import TransferState

_POLL_FIRST_S = 0.00002  # a grant read is a few hundred bytes: usually done within 100 us
_POLL_MAX_S = 0.002


class ReadFailed(Exception):
    """The engine could not read the peer's entries (the caller turns it into PeerUnreachable)."""


@dataclass
class GrantReader:
    """Reads through a backend's hooks. `start(reads)` starts one engine operation reading, for
    each (local address, first page, count), the peer's entries of those pages; `progress(op)`
    says PENDING, DONE or FAILED without blocking; `release(op)` frees a finished operation."""

    table: GrantTable
    start: Callable[[list[tuple[int, int, int]]], Any]
    progress: Callable[[Any], TransferState]
    release: Callable[[Any], None]
    timeout_s: float

    def verify(self, pages: list[int], tag: bytes) -> Refusal | None:
        wanted = numpy.asarray(pages, dtype=numpy.int64)
        entries = numpy.zeros((len(pages), TAG_NBYTES), dtype=numpy.uint8)
        deadline = time.monotonic() + self.timeout_s
        for round_spans in rounds(spans(pages)):
            inside = (wanted >= round_spans[0][0]) & (wanted < round_spans[-1][0] + round_spans[-1][1])
            entries[inside] = self._read_round(round_spans, wanted[inside], deadline)
        return compare_entries(entries, pages, tag)

    def _read_round(self, round_spans: list[tuple[int, int]], pages: numpy.ndarray,
                    deadline: float) -> numpy.ndarray:
        """The entries of `pages` (all inside `round_spans`), read in one engine operation."""
        slot = self.table.acquire_slot(deadline)
        if slot is None:
            raise ReadFailed(f"no grant read slot came free within {self.timeout_s:g} s")
        offsets = numpy.cumsum([0] + [count for _, count in round_spans[:-1]])
        reads = [(self.table.slot_address(slot) + int(at) * TAG_NBYTES, first, count)
                 for at, (first, count) in zip(offsets, round_spans, strict=True)]
        try:
            op = self.start(reads)
        except BaseException:
            self.table.release_slot(slot)
            raise
        state = self._wait(op, deadline)
        if state is TransferState.PENDING:  # abandoned, but the read may still land: keep the slot until then
            self.table.retire_slot(slot, lambda: self._still_busy(op))
            raise ReadFailed(f"the read took more than {self.timeout_s:g} s")
        self.release(op)
        try:
            if state is not TransferState.DONE:
                raise ReadFailed("the read failed in the engine")
            starts = numpy.asarray([first for first, _ in round_spans], dtype=numpy.int64)
            span_of = numpy.searchsorted(starts, pages, side="right") - 1
            return self.table.slot_entries(slot)[offsets[span_of] + pages - starts[span_of]]  # a copy
        finally:
            self.table.release_slot(slot)

    def _wait(self, op: Any, deadline: float) -> TransferState:
        delay = _POLL_FIRST_S
        while True:
            state = self.progress(op)
            if state.finished or time.monotonic() > deadline:
                return state
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)

    def _still_busy(self, op: Any) -> bool:
        if not self.progress(op).finished:
            return True
        self.release(op)
        return False
