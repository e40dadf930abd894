"""Grants: which (room, request) may write each page of a receiver's pool.

Decode reserves pages for a room and makes a random per-request `grant` (16 bytes); the
transfer layer binds the pages to tag(room, grant) and a writer must present the same pair.

Receiver side, every backend: a GRANT TABLE of 16 bytes per pool page in host memory. Entry p
holds tag(key, grant) of the expectation that owns page p, or zeros when no one may write it.
expect() fills the entries of its pages, release_expectation() zeroes them again. One-sided
backends (mooncake, nixl) register the table with their engine next to the pool and put its
address in the endpoint blob, so a sender can READ the entries through the same engine and
endpoint its writes use (verify_grant); the two-sided ucx receiver compares the entries itself
against the grant each write carries.

Why a tag and not the grant: a 16-byte tag per page is what a one-sided reader can compare
without another round trip, it changes with the room *and* the request (a stale call of an
earlier request of the same room, or a call naming another room's pages, sees a different tag),
and the table never holds the grant itself. Peers can read the table, which is harmless: a tag
reveals neither the grant nor anything a forged call could use (only the prefill, which is
trusted, writes; it refuses when the tags it computes from the call's room and grant differ).

What this does not stop: a one-sided engine gives a connected peer the same access to the
table as to the pool, so a compromised prefill *process* could write either. Grants protect
decode's pages from forged, stale or buggy *requests* to honest prefills; keeping untrusted
code off the transfer network is the deployment's job (engines bind only the worker's host).

Sender side, one-sided backends: a few READ SLOTS, local registered buffers that a verify reads
the peer's entries into (one slot per verify in flight, so concurrent verifies never share one).
`GrantReader` reads the entries of the destination pages through the same engine and endpoint the
writes use, so a caller cannot point the check anywhere else: pages are grouped into spans
(nearby pages read together) and spans into rounds that fit one slot, one engine operation per
round, so a prompt's pages cost one read. Comparison happens on the sender.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy
import torch

from libkv.transfer.interface import TransferState

TAG_NBYTES = 16
GRANT_MAX_NBYTES = 64
_PERSON = b"pdserve-grant-v1"  # blake2b personalization: these tags mean nothing elsewhere

# Pages of a verify whose entries are this close together are read as one span: reading a few
# unneeded entries is cheaper than one more engine operation.
SPAN_GAP_ENTRIES = 64
READ_SLOTS = 4
READ_SLOT_ENTRIES = 4096  # 64 KiB per slot; a verify of more pages reads in several rounds


def grant_tag(key: str, grant: bytes = b"") -> bytes:
    """The 16-byte tag that binds pages to (key, grant). Never all zeros (zero = not reserved).

    An empty grant gives the tag of the key alone, so callers that do not pass grants yet keep
    working (with only the room to protect them).
    """
    grant = check_grant(grant)
    encoded_key = key.encode()
    digest = hashlib.blake2b(len(encoded_key).to_bytes(4, "little") + encoded_key + grant,
                             digest_size=TAG_NBYTES, person=_PERSON).digest()
    return digest if any(digest) else b"\x01" + digest[1:]


def check_grant(grant: bytes | bytearray | memoryview) -> bytes:
    if not isinstance(grant, (bytes, bytearray, memoryview)):
        raise TypeError(f"a grant is bytes, got {type(grant).__name__}")
    grant = bytes(grant)
    if len(grant) > GRANT_MAX_NBYTES:
        raise ValueError(f"a grant is at most {GRANT_MAX_NBYTES} bytes, got {len(grant)}")
    return grant


@dataclass(frozen=True)
class Refusal:
    """The outcome of comparing pages' entries with a tag: the first page that does not match
    (in the order the pages were given) and how many do not."""

    first_page: int
    count: int
    total: int


def compare_entries(entries: numpy.ndarray, pages: list[int], tag: bytes) -> Refusal | None:
    """`entries[i]` (16 bytes) is the table entry of pages[i]. Constant time in the entries'
    contents when they all match; on a mismatch the refusal is about to be reported anyway."""
    if hmac.compare_digest(entries.tobytes(), tag * len(pages)):
        return None
    bad = numpy.flatnonzero((entries != numpy.frombuffer(tag, dtype=numpy.uint8)).any(axis=1))
    return Refusal(pages[int(bad[0])], len(bad), len(pages))


def spans(pages: list[int], gap: int = SPAN_GAP_ENTRIES,
          limit: int = READ_SLOT_ENTRIES) -> list[tuple[int, int]]:
    """(first page, count) spans covering `pages`, merging neighbours at most `gap` entries
    apart and splitting so that no span is longer than `limit` entries."""
    result: list[tuple[int, int]] = []
    for page in sorted(set(pages)):
        if result and page - (result[-1][0] + result[-1][1]) <= gap \
                and page - result[-1][0] < limit:
            result[-1] = (result[-1][0], page - result[-1][0] + 1)
        else:
            result.append((page, 1))
    return result


def rounds(all_spans: list[tuple[int, int]], limit: int = READ_SLOT_ENTRIES) -> list[list[tuple[int, int]]]:
    """Group spans into rounds of at most `limit` entries: one slot, one engine operation each."""
    grouped: list[list[tuple[int, int]]] = []
    used = limit
    for span in all_spans:
        if used + span[1] > limit:
            grouped.append([])
            used = 0
        grouped[-1].append(span)
        used += span[1]
    return grouped


class GrantTable:
    """The receiver's grant table plus the sender's read slots, in one host allocation.

    `memory` is what a one-sided backend registers with its engine: the table (16 bytes per
    pool page) followed by READ_SLOTS slots of READ_SLOT_ENTRIES entries. Callers hold the
    backend's lock around bind/clear; reads by peers may race with them and then see a torn
    entry, which simply does not match.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        table_nbytes = num_pages * TAG_NBYTES
        read_slots_nbytes = READ_SLOTS * READ_SLOT_ENTRIES * TAG_NBYTES
        self.memory = torch.zeros(table_nbytes + read_slots_nbytes, dtype=torch.uint8)
        flat = self.memory.numpy()
        self.entries = flat[:table_nbytes].reshape(num_pages, TAG_NBYTES)
        self._slots = flat[table_nbytes:].reshape(READ_SLOTS, READ_SLOT_ENTRIES, TAG_NBYTES)
        self._expected: dict[str, frozenset[int]] = {}  # key -> its pages bound in the table
        self._tags: dict[str, bytes] = {}  # key -> tag(key, grant) of its expectation
        self._free = list(range(READ_SLOTS))
        self._retired: list[tuple[int, Callable[[], bool]]] = []
        self._slot_ready = threading.Condition()

    # ---- receiver: the table ---------------------------------------------------------------

    @property
    def table_nbytes(self) -> int:
        return self.num_pages * TAG_NBYTES

    def address(self) -> int:
        return self.memory.data_ptr()

    def owners(self, pages: list[int]) -> numpy.ndarray:
        return self.entries[pages]

    def bind(self, pages: list[int], tag: bytes) -> None:
        self.entries[pages] = numpy.frombuffer(tag, dtype=numpy.uint8)

    def clear(self, pages: list[int]) -> None:
        self.entries[pages] = 0

    def check(self, first_page: int, count: int, tag: bytes) -> Refusal | None:
        """Compare the entries of pages first_page .. first_page+count-1 with `tag`."""
        return compare_entries(self.entries[first_page:first_page + count],
                               list(range(first_page, first_page + count)), tag)

    # ---- receiver: expectations (the backend's expect / release_expectation) --------------

    def expect(self, key: str, pages: list[int], tag: bytes) -> frozenset[int]:
        """Bind `pages` to `tag` for `key` and return all the key's pages. Calls for one key
        accumulate pages but must give the same tag; a page bound to another key is refused
        (ValueError): a page belongs to one room at a time."""
        known = self._tags.get(key)
        if known is not None and known != tag:
            raise ValueError(f"expect({key!r}): the key is already expected with another grant; "
                             "release_expectation() first")
        new = sorted(set(pages))
        taken = [p for p, owner in zip(new, self.owners(new), strict=True)
                 if owner.any() and owner.tobytes() != tag]
        if taken:
            holders = sorted({k for k, held in self._expected.items() if taken[0] in held})
            raise ValueError(f"expect({key!r}): page {taken[0]} (and {len(taken) - 1} more) already "
                             f"expected by {', '.join(map(repr, holders)) or 'another key'}")
        self.bind(new, tag)
        self._expected[key] = frozenset(new) | self._expected.get(key, frozenset())
        self._tags[key] = tag
        return self._expected[key]

    def release(self, key: str) -> frozenset[int] | None:
        """Zero the entries of the key's pages and forget it; its pages (None if not expected)."""
        pages = self._expected.pop(key, None)
        self._tags.pop(key, None)
        if pages is not None:
            self.clear(sorted(pages))
        return pages

    def expected(self, key: str) -> frozenset[int]:
        return self._expected.get(key, frozenset())

    # ---- sender: read slots ----------------------------------------------------------------

    def slot_address(self, slot: int) -> int:
        return self.address() + self.table_nbytes + slot * READ_SLOT_ENTRIES * TAG_NBYTES

    def slot_entries(self, slot: int) -> numpy.ndarray:
        return self._slots[slot]

    def acquire_slot(self, deadline: float) -> int | None:
        """A free read slot, or None if none frees up before `deadline`."""
        with self._slot_ready:
            while True:
                self._revive()
                if self._free:
                    return self._free.pop()
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                # Retired slots free themselves without notifying: look again now and then.
                self._slot_ready.wait(min(left, 0.05))

    def release_slot(self, slot: int) -> None:
        with self._slot_ready:
            self._free.append(slot)
            self._slot_ready.notify()

    def retire_slot(self, slot: int, busy: Callable[[], bool]) -> None:
        """A read into `slot` was abandoned but may still land: reuse the slot only once
        `busy()` says the engine is done with it."""
        with self._slot_ready:
            self._retired.append((slot, busy))

    def _revive(self) -> None:
        still = []
        for slot, busy in self._retired:
            try:
                done = not busy()
            except Exception:
                done = False
            if done:
                self._free.append(slot)
            else:
                still.append((slot, busy))
        self._retired = still


# ---- sender: verify_grant of one-sided engines, reading the peer's table ----------------------

_READ_POLL_FIRST_S = 0.00002  # a grant read is a few hundred bytes: usually done within 100 us
_READ_POLL_MAX_S = 0.002


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
        delay = _READ_POLL_FIRST_S
        while True:
            state = self.progress(op)
            if state.finished or time.monotonic() > deadline:
                return state
            time.sleep(delay)
            delay = min(delay * 2, _READ_POLL_MAX_S)

    def _still_busy(self, op: Any) -> bool:
        if not self.progress(op).finished:
            return True
        self.release(op)
        return False
