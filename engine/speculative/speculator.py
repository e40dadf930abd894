"""Speculator: turns decode rows into verify chunks before a step and settles them after it.

Protocol, on the engine thread (engine/engine_thread.py), each step:
1. `propose(batch, policy)` after the scheduler built the batch: each decode row whose request may
   draft (`policy(request).most` > 0: tokens left to generate, and greedy unless the drafter gives
   the drafts' distribution for rejection sampling: a draft model, NEXTN), whose budget allows it
   (engine.speculative.adaptive: its own acceptance and the engine's) and whose drafter proposes
   something becomes a verify chunk in `batch.extends`: its last token and its drafts from position
   num_computed, `num_drafts` set, pages grown to hold them (no drafts when that needs pages that
   are not free: a draft never forces a retraction). Other rows stay plain decodes, so one batch
   mixes speculating and plain rows with per-request draft lengths.
2. The runner returns num_drafts + 1 rows of logits for a verify chunk; for a greedy request the
   thread takes each row's argmax and calls `accept(chunk, row_tokens)`: the drafts the target agrees
   with, in order, then the target's own token after them; for a sampled one it calls
   `accept_sampled(chunk, target_probs, generator)` (engine.speculative.rejection). The thread emits
   those tokens (a stop token or the length limit may end the request among them).
3. `settle(request)` for a request still running: only the K/V of its last token
   and of the accepted drafts is kept (num_computed), pages past what its tokens need are freed
   (the rejected drafts' slots are simply overwritten later; pages the prefix cache holds are
   always full pages of computed tokens, never a rejected draft's).
4. `forget(room)` when a request leaves.
With NEXTN (engine.speculative.nextn) the thread also calls `observe(batch)` right after each
forward, before the scheduler advances the batch: the MTP layer reads the target's hidden states.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.page_manager import PageManager
from engine.sampling import SamplingParams
from engine.scheduler import Request, ScheduledChunk, Scheduler, SchedulerOutput
from engine.speculative.adaptive import DRAFT_COST, DraftBudget, EngineAcceptance, Gate
from engine.speculative.config import SpeculativeConfig
from engine.speculative.draft_model import DraftModel, Drafts
from engine.speculative.nextn import DraftRequest, NextNDrafter
from engine.speculative.ngram import NgramIndex
from engine.speculative.rejection import rejection_sample

# proposes up to n drafts for a request's tokens
Drafter = Callable[[Request, int], list[int]]

# NEXTN: target hidden states a request keeps while the engine does not draft (engine.speculative.nextn)
HELD_WHILE_NOT_DRAFTING = 8


@dataclass(frozen=True)
class DraftPolicy:
    """What the engine thread allows one request this step: at most `most` drafts (0: none), drawn
    under `params` with `generator` (a seeded request's draft generator)."""

    most: int
    params: SamplingParams
    generator: torch.Generator | None = None


@dataclass
class SpeculativeStats:
    """Running totals: tokens drafted and accepted, and verify rows (one per request per step)."""

    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_rows: int = 0


class _RequestDrafts:
    def __init__(self, config: SpeculativeConfig, start: int | None) -> None:
        self.index = NgramIndex(config.speculative_ngram_min_match, config.speculative_ngram_max_match)
        self.budget = DraftBudget(config.max_drafts, start)


class Speculator:
    """Drafts, and the accounting of what was accepted (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig, scheduler: Scheduler, pages: PageManager,
                 drafter: Drafter | None = None, draft_model: DraftModel | None = None,
                 nextn: NextNDrafter | None = None) -> None:
        self.config = config
        self.draft_model = draft_model
        self.nextn = nextn  # NEXTN: drafts of every decode row come from one batched MTP pass
        # with a draft model or the MTP layer, sampled requests speculate too (their drafts come with
        # the distribution they were drawn from, for rejection sampling)
        self.samples = draft_model is not None or nextn is not None
        assert config.speculative_algorithm is not None
        self.acceptance = EngineAcceptance(DRAFT_COST[config.speculative_algorithm], config.max_drafts)
        self._gate = Gate.OPEN
        self._draft_probs: dict[str, torch.Tensor] = {}
        self.scheduler = scheduler
        self.pages = pages
        self.stats = SpeculativeStats()
        self._requests: dict[str, _RequestDrafts] = {}
        self._drafter = drafter or self._ngram

    def _state(self, room: str, seeded: bool = False) -> _RequestDrafts:
        state = self._requests.get(room)
        if state is None:
            # a seeded sampled request drafts by its own history only: its draft lengths, and so its
            # draws, must not depend on what other requests did before it (it stays reproducible)
            state = self._requests[room] = _RequestDrafts(
                self.config, None if seeded else self.acceptance.start_length())
        return state

    def _ngram(self, request: Request, max_drafts: int) -> list[int]:
        return self._state(request.room).index.propose(request.token_ids, max_drafts)

    def propose(self, batch: SchedulerOutput, policy: Callable[[Request], DraftPolicy]) -> None:
        """Turn the batch's decode rows that draft into verify chunks (step 1 of the protocol)."""
        if not batch.decodes:
            return
        self._gate = self.acceptance.gate()
        if self.nextn is not None:
            # while the engine does not draft, the MTP catch-up of a later probe stays short
            self.nextn.max_held = None if self._gate is Gate.OPEN else HELD_WHILE_NOT_DRAFTING
        kept: list[ScheduledChunk] = []
        nextn_drafts = self._nextn_drafts(batch, policy) if self.nextn is not None else {}
        for chunk in batch.decodes:
            request = self.scheduler.requests[chunk.room]
            if self.nextn is not None:
                proposed = nextn_drafts.get(chunk.room)
                drafts = proposed.tokens if proposed is not None else []
                if proposed is not None and proposed.probs is not None:
                    self._draft_probs[chunk.room] = proposed.probs
            else:
                drafts = self._drafts(request, policy(request)) if chunk.multimodal is None else []
            if drafts and self.pages.grow(request.page_ids, request.num_tokens + len(drafts),
                                          keep_free=len(self.scheduler.running)):
                batch.extends.append(ScheduledChunk(
                    room=chunk.room, token_ids=chunk.token_ids + drafts, start_pos=chunk.start_pos,
                    page_ids=request.page_ids, sample=True, num_drafts=len(drafts)))
            else:
                kept.append(chunk)
        batch.decodes = kept

    def _nextn_drafts(self, batch: SchedulerOutput, policy: Callable[[Request], DraftPolicy]
                      ) -> dict[str, Drafts]:
        assert self.nextn is not None
        wanted: list[DraftRequest] = []
        for chunk in batch.decodes:
            request = self.scheduler.requests[chunk.room]
            if request.prefill_only:  # its last prompt token as a decode: its MTP K/V is still written
                continue
            request_policy = policy(request)
            if request_policy.most <= 0:  # never drafts again (penalized, logprobs, or at its end)
                self.nextn.stop_tracking(chunk.room)
                continue
            wanted.append(DraftRequest(request, self._allowed(request, request_policy), request_policy.params,
                                       request_policy.generator))
        return self.nextn.propose(wanted, keep_free=len(self.scheduler.running))

    def _allowed(self, request: Request, policy: DraftPolicy) -> int:
        """Drafts the request may verify this step (its budget counts the step when it may draft):
        by its budget when the engine's acceptance makes drafting worth it, when its own last verify
        accepted something, or when it is seeded (reproducible); else one on a probe step, or none."""
        most = min(policy.most, self.config.max_drafts)
        if most <= 0:
            return 0
        seeded = policy.params.seed is not None and not policy.params.greedy
        budget = self._state(request.room, seeded).budget
        if self._gate is Gate.OPEN or budget.accepting or seeded:
            return min(most, budget.next())
        return 1 if self._gate is Gate.PROBE else 0

    def _drafts(self, request: Request, policy: DraftPolicy) -> list[int]:
        allowed = self._allowed(request, policy)
        if allowed <= 0:
            return []
        if self.draft_model is None:
            return self._drafter(request, allowed)
        drafts = self.draft_model.propose(request, allowed, policy.params, policy.generator)
        if drafts.probs is not None:
            self._draft_probs[request.room] = drafts.probs
        return drafts.tokens

    def accept(self, chunk: ScheduledChunk, row_tokens: list[int]) -> list[int]:
        """The tokens a verify chunk yields: the drafts matching the target's tokens at their
        positions, then the target's token after the last match (step 2; greedy)."""
        drafts = chunk.token_ids[1:]
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == row_tokens[accepted]:
            accepted += 1
        self.stats.drafted_tokens += len(drafts)
        self.stats.accepted_tokens += accepted
        self._record(chunk.room, len(drafts), accepted)
        return row_tokens[:accepted + 1]

    def accept_sampled(self, chunk: ScheduledChunk, target_probs: torch.Tensor,
                       generator: torch.Generator | None) -> list[int]:
        """`accept` for a sampled request: rejection sampling against the drafts' distribution, so the
        tokens are distributed as the target's alone would be."""
        drafts = chunk.token_ids[1:]
        tokens = rejection_sample(target_probs, self._draft_probs.pop(chunk.room), drafts, generator)
        accepted = len(tokens) - 1
        self.stats.drafted_tokens += len(drafts)
        self.stats.accepted_tokens += accepted
        self._record(chunk.room, len(drafts), accepted)
        return tokens

    def _record(self, room: str, drafted: int, accepted: int) -> None:
        self.stats.verify_rows += 1
        self._state(room).budget.record(drafted, accepted)
        self.acceptance.record(drafted, accepted)

    def settle(self, request: Request) -> None:
        """After a still-running request's accepted tokens were appended: its K/V is that of every
        token but the newest (step 3); pages beyond its tokens go back to the pool."""
        request.num_computed = request.num_tokens - 1
        if self.nextn is not None:
            self.nextn.trim(request)
        needed = self.pages.pages_for(request.num_tokens)
        if len(request.page_ids) > needed:
            extra = request.page_ids[needed:]
            del request.page_ids[needed:]
            self.pages.free(extra)

    def forget(self, room: str) -> None:
        self._requests.pop(room, None)
        self._draft_probs.pop(room, None)
        if self.draft_model is not None:
            self.draft_model.forget(room)
        if self.nextn is not None:
            self.nextn.forget(room)

    def observe(self, batch: SchedulerOutput) -> None:
        """After the target's forward, before the scheduler advances the batch: NEXTN keeps the
        target's hidden states its MTP layer reads."""
        if self.nextn is not None:
            self.nextn.observe(batch)
            prefilling = [self.scheduler.requests[c.room] for c in batch.extends]
            self.nextn.write_prompt_kv([r for r in prefilling if r.prefill_only])

    def prefilled(self, request: Request) -> None:
        """A prefill-only request sampled its first token, before its pages are reported: NEXTN writes
        the MTP K/V of its last prompt position (whose next token that is)."""
        if self.nextn is not None:
            self.nextn.write_prompt_kv([request])
