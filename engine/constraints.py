"""What changes a batch's logits between the forward pass and the sampler: penalties, biases and
min_tokens (engine.penalties) and structured-output masks (engine.grammar), for the rows that ask
for them; rows that ask for nothing cost nothing.

The engine thread calls `apply` before sampling and `accept` with the sampled tokens; `accept` also
starts the next step's masks, which a worker thread computes while the next forward pass runs
(engine.next_masks). State is rebuilt from each request's tokens the first time it samples here (see
engine.penalties and engine.grammar), so nothing of it travels between processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from engine.grammar import GrammarStats, RequestGrammar, apply_masks
from engine.next_masks import NextMasks
from engine.penalties import PenaltyTable, apply_penalties

if TYPE_CHECKING:
    from engine.engine_thread import RequestIO
    from engine.scheduler import Request


class LogitsConstraints:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.table: PenaltyTable | None = None
        self.stats = GrammarStats()  # constrained_steps (compile counters: GrammarCompiler.stats)
        self._last_slots: torch.Tensor | None = None
        self._last_rows: list[int] = []
        self._prefill_only: list[bool] = []
        self._last_grammars: list[int] = []
        self._next_masks: NextMasks | None = None

    def apply(self, logits: torch.Tensor, requests: Sequence[Request],
              ios: Sequence[RequestIO]) -> torch.Tensor:
        self._last_rows = [i for i, io in enumerate(ios) if io.params.penalized]
        self._last_slots = None
        raw = logits
        if self._last_rows:
            logits = self._penalize(logits, requests, ios)
        if self._next_masks is not None:
            self._next_masks.wait()  # the grammars are the worker thread's until then
        self._last_grammars = [i for i, io in enumerate(ios) if io.grammar is not None
                               and io.grammar.sync(requests[i].token_ids[_output_start(requests[i], io):])]
        self._prefill_only = [requests[i].prefill_only for i in self._last_grammars]
        if self._last_grammars:
            grammars: list[RequestGrammar] = [ios[i].grammar for i in self._last_grammars]  # type: ignore[misc]
            if self._next_masks is None:
                self._next_masks = NextMasks(logits.shape[1])
            bitmask = self._next_masks.take(grammars)
            rows = torch.tensor(self._last_grammars, device=logits.device)
            logits = apply_masks(logits, rows, bitmask)
            self.stats.constrained_steps += len(grammars)
            if self._last_rows:
                dead = torch.isneginf(logits[rows]).all(dim=1)
                if bool(dead.any()):
                    # min_tokens banned every token the grammar allows (it can only end now): the
                    # grammar wins, on the row's unpenalized logits
                    logits[rows[dead]] = apply_masks(raw, rows[dead], bitmask[dead])[rows[dead]]
        return logits

    def _penalize(self, logits: torch.Tensor, requests: Sequence[Request],
                  ios: Sequence[RequestIO]) -> torch.Tensor:
        if self.table is None:
            self.table = PenaltyTable(logits.shape[1], logits.device)
        table = self.table
        rows = self._last_rows
        slots = [table.slot(requests[i].room, requests[i].token_ids, _output_start(requests[i], ios[i]))
                 for i in rows]
        self._last_slots = torch.tensor(slots, dtype=torch.int64, device=logits.device)
        return apply_penalties(logits, torch.tensor(rows, device=logits.device), self._last_slots, table,
                               [ios[i].params for i in rows], [requests[i].num_generated for i in rows],
                               [ios[i].stop_token_ids for i in rows])

    def accept(self, ios: Sequence[RequestIO], token_ids: torch.Tensor, token_list: Sequence[int]) -> None:
        """Count the sampled tokens of the rows `apply` penalized; advance the grammars it masked."""
        if self._last_slots is not None and self.table is not None:
            rows = torch.tensor(self._last_rows, device=token_ids.device)
            self.table.add_tokens(self._last_slots, token_ids[rows])
        advanced: list[RequestGrammar] = []
        for i, prefill_only in zip(self._last_grammars, self._prefill_only, strict=True):
            grammar = ios[i].grammar
            if grammar is not None:
                grammar.accept(token_list[i])
                if not prefill_only:  # a prefill-only request samples here once
                    advanced.append(grammar)
        if advanced and self._next_masks is not None:
            self._next_masks.start(advanced)

    def release(self, room: str) -> None:
        if self.table is not None:
            self.table.release(room)

    def close(self) -> None:
        """Stop the mask worker thread (the engine thread is done stepping)."""
        if self._next_masks is not None:
            self._next_masks.close()


def _output_start(request: Request, io: RequestIO) -> int:
    """Where the request's output begins in its tokens: a migrated continuation's carried tokens
    (the end of its prompt) are output too."""
    return request.num_prompt - io.carried_tokens
