"""NEXTN drafting: DeepSeek-V3's MTP layer (engine.models.mtp) proposes the drafts.

The MTP layer's K/V lives in the KV pool's extra layer (num_hidden_layers), in the request's own
pages: it follows the request through the prefix cache, retraction and PD's page transfer with no
bookkeeping of its own. Its K/V at position i needs the target's hidden state h_i and the token
t_{i+1}, so it runs one step behind the target:

1. `observe(batch)` after each target forward keeps, per request, the target's final-normed hidden
   states of the positions whose MTP K/V is not written yet (`_Sequence.hidden`, from `done`).
   A verify chunk's rows past what it accepted are dropped by `trim` (Speculator.settle).
2. `propose` (before the next forward) runs, for the requests that draft, one catch-up forward of
   the MTP layer over those positions (their tokens are the next ones, all known by then); its last
   row gives the first draft, and each further draft is one MTP step on the previous draft with
   the MTP's own output as the hidden state. The drafts' K/V at positions past the target's is
   overwritten by the next catch-up. A greedy request's drafts are the argmax; a sampled one's are
   drawn from the MTP's distribution under the request's sampling params, which come back with them
   for rejection sampling (engine.speculative.rejection).

While the engine does not draft (a drafter it found poor: engine.speculative.adaptive), a request
keeps only its newest `max_held` hidden states: the positions it drops keep stale MTP K/V (as after
a prefix-cache hit, below), so a probe's catch-up stays short instead of covering every step since.

A request whose pages came with K/V this drafter did not write (a prefix-cache hit, a PD transfer)
starts at the first position the target computes for it; the MTP K/V of the earlier positions is
whatever those pages hold (written by the request that filled them, or, where none did, stale),
which can lower acceptance but never changes output: every draft is verified by the target.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model_runner import ModelRunner
from engine.models.decoder import DecoderModel
from engine.models.mtp import MTPLayer
from engine.page_manager import PageManager
from engine.sampling import SamplingParams, sampling_probs
from engine.scheduler import Request, ScheduledChunk, SchedulerOutput
from engine.speculative.draft_model import Drafts
from engine.speculative.nextn_ranks import MTPDriverRunner
from engine.tp.group import TPGroup
from libkv.pool import KVPool


@dataclass(frozen=True)
class DraftRequest:
    """A decoding request that may draft up to `most` tokens, drawn under `params` (argmax when
    greedy) with `generator` (a seeded request's draft stream)."""

    request: Request
    most: int
    params: SamplingParams
    generator: torch.Generator | None = None


@dataclass
class _Sequence:
    done: int  # positions 0..done-1 have their MTP K/V written
    hidden: torch.Tensor  # [m, hidden]: the target's h of positions done..done+m-1

    @property
    def held_until(self) -> int:
        return self.done + self.hidden.shape[0]


class NextNDrafter:
    """Runs the MTP layer for the engine thread (its only caller); see the module docstring."""

    def __init__(self, target: DecoderModel, mtp: MTPLayer, pool: KVPool, pages: PageManager,
                 group: TPGroup | None = None) -> None:
        if pool.layout.num_layers <= mtp.kv_layer:
            raise ValueError(f"NEXTN: the KV pool has {pool.layout.num_layers} layers, the MTP layer needs "
                             f"layer {mtp.kv_layer}")
        self.target = target
        self.mtp = mtp
        self.pages = pages
        runner = ModelRunner(mtp, pool)  # type: ignore[arg-type]  # DecoderModel's forward signature
        # tensor-parallel (`group`): each MTP forward runs on every rank's shard
        self.runner: ModelRunner | MTPDriverRunner = \
            runner if group is None else MTPDriverRunner(runner, mtp, group)
        target.keep_normed_hidden = True
        self._sequences: dict[str, _Sequence] = {}
        self._untracked: set[str] = set()  # requests that never draft (penalized, logprobs, ...)
        self.max_held: int | None = None  # hidden states kept per request (None: all; see above)

    def observe(self, batch: SchedulerOutput) -> None:
        """After the target's forward over `batch` (before the scheduler advances it): keep each
        request's new rows of the target's hidden states."""
        hidden = self.target.normed_hidden
        if hidden is None:
            return
        row = 0
        # the runner's flattened order: a row per decode, then every token of each extend
        counted = [(c, 1) for c in batch.decodes] + [(c, len(c.token_ids)) for c in batch.extends]
        for chunk, count in counted:
            rows, row = hidden[row:row + count], row + count
            if chunk.room in self._untracked:
                continue
            sequence = self._sequences.get(chunk.room)
            start = chunk.start_pos
            if sequence is None or start < sequence.done or start > sequence.held_until:
                # a new request, K/V recomputed (retraction), or positions it did not compute
                self._sequences[chunk.room] = _Sequence(start, rows.clone())
            else:
                kept = sequence.hidden[:start - sequence.done]
                sequence.hidden = torch.cat([kept, rows])
            sequence = self._sequences[chunk.room]
            if self.max_held is not None and sequence.hidden.shape[0] > self.max_held:
                dropped = sequence.hidden.shape[0] - self.max_held
                sequence.done, sequence.hidden = sequence.done + dropped, sequence.hidden[dropped:]

    def trim(self, request: Request) -> None:
        """Forget hidden states past the request's computed positions (a verify's rejected drafts)."""
        sequence = self._sequences.get(request.room)
        if sequence is not None and sequence.held_until > request.num_computed:
            sequence.hidden = sequence.hidden[:max(0, request.num_computed - sequence.done)]

    def stop_tracking(self, room: str) -> None:
        """The request will not draft again: hold nothing more for it."""
        self._untracked.add(room)
        self._sequences.pop(room, None)

    def forget(self, room: str) -> None:
        self._untracked.discard(room)
        self._sequences.pop(room, None)

    def write_prompt_kv(self, requests: list[Request]) -> None:
        """PD prefill: write the MTP K/V of each prefill-only request's positions whose next token is
        known (all but the last prompt position before its first token is sampled, then that one too),
        so the pages it reports carry it to decode with the target's K/V."""
        chunks, hidden = [], []
        for request in requests:
            sequence = self._sequences.get(request.room)
            if sequence is None:
                continue
            until = min(sequence.held_until, request.num_tokens - 1)
            if until <= sequence.done:
                continue
            count = until - sequence.done
            chunks.append(ScheduledChunk(
                room=request.room, token_ids=request.token_ids[sequence.done + 1:until + 1],
                start_pos=sequence.done, page_ids=request.page_ids, sample=False))
            hidden.append(sequence.hidden[:count])
            sequence.done, sequence.hidden = until, sequence.hidden[count:]
        if chunks:
            self.mtp.hidden_in = torch.cat(hidden)
            self.runner.step(SchedulerOutput(extends=chunks))

    def propose(self, wanted: list[DraftRequest], keep_free: int) -> dict[str, Drafts]:
        """Drafts for each decoding request (up to its `most`), or none where the request holds no new
        hidden state or its pages cannot grow for the verify."""
        ready: list[tuple[DraftRequest, _Sequence]] = []
        for item in wanted:
            request, most = item.request, item.most
            sequence = self._sequences.get(request.room)
            if most <= 0 or sequence is None or sequence.hidden.shape[0] == 0 or \
                    sequence.held_until != request.num_computed:
                continue
            # the verify's pages (the drafts' MTP K/V lies within them)
            if self.pages.grow(request.page_ids, request.num_tokens + most, keep_free=keep_free):
                ready.append((item, sequence))
        if not ready:
            return {}
        # catch-up: each request's MTP K/V up to its newest token; its last row gives the first draft
        catch_up = SchedulerOutput(extends=[ScheduledChunk(
            room=d.request.room, token_ids=d.request.token_ids[s.done + 1:d.request.num_computed + 1],
            start_pos=s.done, page_ids=d.request.page_ids, sample=True) for d, s in ready])
        self.mtp.hidden_in = torch.cat([s.hidden for _, s in ready])
        logits = self.runner.forward(catch_up)
        ends = torch.tensor([len(c.token_ids) for c in catch_up.extends]).cumsum(0) - 1
        assert self.mtp.last_hidden is not None
        previous = self.mtp.last_hidden.index_select(0, ends.to(self.mtp.last_hidden.device))
        tokens: dict[str, list[int]] = {d.request.room: [] for d, _ in ready}
        probs: dict[str, list[torch.Tensor]] = {d.request.room: [] for d, _ in ready}
        self._pick(logits, [d for d, _ in ready], tokens, probs)
        for item, sequence in ready:
            sequence.done, sequence.hidden = item.request.num_computed, sequence.hidden[:0]
        # further drafts: one MTP step per draft on the previous one, its own output as h
        active = [d for d, _ in ready]
        for step in range(1, max(d.most for d in active)):
            keep = [j for j, d in enumerate(active) if d.most > step]
            active, previous = [active[j] for j in keep], previous[keep]
            batch = SchedulerOutput(decodes=[ScheduledChunk(
                room=d.request.room, token_ids=[tokens[d.request.room][-1]],
                start_pos=d.request.num_computed + step - 1, page_ids=d.request.page_ids, sample=True)
                for d in active])
            self.mtp.hidden_in = previous
            logits = self.runner.forward(batch)
            assert self.mtp.last_hidden is not None
            previous = self.mtp.last_hidden
            self._pick(logits, active, tokens, probs)
        return {room: Drafts(drafted, torch.stack(probs[room]) if probs[room] else None)
                for room, drafted in tokens.items()}

    @staticmethod
    def _pick(logits: torch.Tensor, rows: list[DraftRequest], tokens: dict[str, list[int]],
              probs: dict[str, list[torch.Tensor]]) -> None:
        """Append each row's next draft: the argmax for a greedy request, else a draw from the MTP's
        distribution under its params (kept in `probs` for the verify's rejection sampling)."""
        argmax = logits.argmax(dim=-1).tolist()
        sampled = [i for i, d in enumerate(rows) if not d.params.greedy]
        distributions = sampling_probs(logits[sampled].float(), [rows[i].params for i in sampled]) \
            if sampled else None
        for i, item in enumerate(rows):
            tokens[item.request.room].append(argmax[i])
        for j, i in enumerate(sampled):
            assert distributions is not None
            room = rows[i].request.room
            tokens[room][-1] = int(torch.multinomial(distributions[j], 1, generator=rows[i].generator))
            probs[room].append(distributions[j])
