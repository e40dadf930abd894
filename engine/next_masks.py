"""The next step's grammar masks, computed in a worker thread while the forward pass runs.

A constrained request's mask for step n+1 depends only on the tokens it has accepted, that is on
the token sampled at step n; so does the forward pass of step n+1. The engine thread therefore
starts the masks right after a step's tokens are accepted (`start`) and picks them up after the
next forward pass (`take`): llguidance computes a mask with the GIL released, so the two overlap.
A request whose grammar moved on since (or that was not in the previous step: a new request, one
back from retraction) has its mask computed in `take`, on the engine thread, as before.

One preallocated bitmask buffer holds the prefetched rows (grown when a batch outgrows it); `take`
returns the batch's rows without a copy when they are the prefetched ones in order.

Thread protocol: only the engine thread calls `start` and `take`. While a prefetch runs, its
matchers belong to the worker thread (llguidance refuses a matcher used from two threads at
once), so the engine thread touches no grammar between `start` and the `wait` that `take` (and
the next `start`) begins with.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from engine.grammar import fill_rows

if TYPE_CHECKING:
    from engine.grammar import RequestGrammar


class NextMasks:
    def __init__(self, vocab_size: int) -> None:
        self.words = (vocab_size + 31) // 32
        self._buffer = torch.zeros((0, self.words), dtype=torch.int32)
        # id(grammar) -> (grammar, its `seen` when the mask was started, buffer row)
        self._rows: dict[int, tuple[RequestGrammar, int, int]] = {}
        self._pending: Future[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self.prefetched = 0  # rows taken from a prefetch (the rest were computed in `take`)

    def start(self, grammars: Sequence[RequestGrammar]) -> None:
        """Begin the masks of `grammars` (those whose constraint applies to their next token)."""
        self.wait()
        active = [g for g in grammars if g.start is not None and not g.failed]
        self._rows = {}
        if not active:
            return
        if self._buffer.shape[0] < len(active):
            self._buffer = torch.zeros((max(8, 2 * len(active)), self.words), dtype=torch.int32)
        self._rows = {id(g): (g, g.seen, row) for row, g in enumerate(active)}
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        jobs = [(g.matcher, self._buffer[row].data_ptr()) for row, g in enumerate(active)]
        self._pending = self._executor.submit(_compute, jobs, self.words * 4)

    def wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def take(self, grammars: Sequence[RequestGrammar]) -> torch.Tensor:
        """The bitmask [len(grammars), words] of each grammar's next token (already synced); the
        rows not prefetched are computed here."""
        self.wait()
        rows: list[int] = []
        missing: list[int] = []
        for index, grammar in enumerate(grammars):
            hit = self._rows.get(id(grammar))
            if hit is not None and hit[0] is grammar and hit[1] == grammar.seen:
                rows.append(hit[2])
            else:
                rows.append(-1)
                missing.append(index)
        self._rows = {}
        self.prefetched += len(grammars) - len(missing)
        if not missing and rows == list(range(len(rows))):
            return self._buffer[:len(rows)]
        out = torch.empty((len(grammars), self.words), dtype=torch.int32)
        hits = [i for i, row in enumerate(rows) if row >= 0]
        if hits:
            out[hits] = self._buffer[[rows[i] for i in hits]]
        fill_rows([grammars[i] for i in missing], out, missing)
        return out

    def close(self) -> None:
        self.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def _compute(jobs: list[tuple[object, int]], mask_bytes: int) -> None:
    for matcher, pointer in jobs:
        matcher.unsafe_compute_mask_ptr(pointer, mask_bytes)  # type: ignore[attr-defined]
