"""How much to draft: per request (DraftBudget) and across requests (EngineAcceptance).

A drafted token pays off only when it is accepted often enough to cover its cost: the drafter's
work for it plus its position in the verify forward, a share `cost` of a plain decode step
(DRAFT_COST). With a per-token acceptance rate a, the k-th draft of a chain is accepted with
probability about a**k, so drafting is worth it up to the longest k with a**k > cost
(`draft_length`), and not at all when a <= cost.

DraftBudget follows one request: draft one more than was last accepted (up to the most), and after
a run of verifies that accepted nothing, stop drafting for a pause that doubles each time it happens
again (up to MAX_PAUSE steps).

EngineAcceptance follows every verify of the engine (one per speculator, so per algorithm): an EMA
of the share of drafted tokens accepted. A new request starts drafting from it rather than from the
most, and while it says drafting is not worth it (a poor drafter), requests without their own
evidence of acceptance decode plainly: the engine then drafts only on probe steps, one draft per
row, every FIRST_PAUSE steps doubling up to MAX_PAUSE while probes accept nothing. A request whose
own last verify accepted something keeps drafting by its own budget whatever the engine's rate, so
one request that copies its prompt among many that do not still speculates.
"""

from __future__ import annotations

from enum import Enum

MISSES_BEFORE_PAUSE = 2
FIRST_PAUSE = 4
MAX_PAUSE = 128

# A drafted token's cost, as a share of a plain decode step: its verify position (memory-bound steps
# make it small) plus the drafter's work. NEXTN: one MTP layer and the LM head per draft (a seventh of
# the small DeepSeek preset's weights; less on a real 61-layer checkpoint). STANDALONE: a draft model
# of a few layers; one as large as the target costs a whole step and pays only when always right.
DRAFT_COST = {"NGRAM": 0.05, "NEXTN": 0.2, "STANDALONE": 0.3}
EMA_WEIGHT = 0.1  # per verify row: a batch of 16 rejected probes moves the rate most of the way
INITIAL_RATE = 0.5  # before any verify: draft a little, learn from it


def draft_length(rate: float, cost: float, most: int) -> int:
    """Drafts worth proposing at acceptance rate `rate`: the longest k <= most with rate**k > cost."""
    length, marginal = 0, rate
    while length < most and marginal > cost:
        length, marginal = length + 1, marginal * rate
    return length


class Gate(Enum):
    """What the engine allows requests without their own evidence of acceptance this step."""

    OPEN = "open"  # draft by their budgets
    PROBE = "probe"  # one draft each, to measure the drafter again
    CLOSED = "closed"  # decode plainly


class EngineAcceptance:
    """Across requests (see the module docstring): `gate()` once per step that has decode rows,
    `record()` after each verify, `start_length()` for a new request's first budget."""

    def __init__(self, cost: float, max_drafts: int) -> None:
        self.cost = cost
        self.max_drafts = max_drafts
        self.rate = INITIAL_RATE
        self.probe_every = FIRST_PAUSE
        self._steps_to_probe = FIRST_PAUSE

    @property
    def worth_drafting(self) -> bool:
        return draft_length(self.rate, self.cost, self.max_drafts) > 0

    def start_length(self) -> int:
        """A new request's first draft length (at least 1: it may earn its own trust)."""
        return max(1, draft_length(self.rate, self.cost, self.max_drafts))

    def record(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.rate += EMA_WEIGHT * (accepted / drafted - self.rate)
        if accepted > 0:  # a probe found something: measure again soon
            self.probe_every = FIRST_PAUSE
            self._steps_to_probe = min(self._steps_to_probe, FIRST_PAUSE)

    def gate(self) -> Gate:
        if self.worth_drafting:
            self.probe_every = self._steps_to_probe = FIRST_PAUSE
            return Gate.OPEN
        self._steps_to_probe -= 1
        if self._steps_to_probe > 0:
            return Gate.CLOSED
        self.probe_every = min(self.probe_every * 2, MAX_PAUSE)  # while probes find nothing
        self._steps_to_probe = self.probe_every
        return Gate.PROBE


class DraftBudget:
    """Per request; `next()` before drafting, `record()` after its verify."""

    def __init__(self, max_drafts: int, start: int | None = None) -> None:
        self.max_drafts = max_drafts
        self.drafts = max_drafts if start is None else min(start, max_drafts)
        self.misses = 0  # verifies in a row that accepted nothing
        self.pause = 0  # steps left without drafting
        self.next_pause = FIRST_PAUSE
        self.accepting = False  # its last verify accepted a draft

    def next(self) -> int:
        """Drafts allowed this step (0: decode one token without drafting)."""
        if self.pause > 0:
            self.pause -= 1
            return 0
        return self.drafts

    def record(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.accepting = accepted > 0
        if accepted == 0:
            self.misses += 1
            self.drafts = max(1, self.drafts // 2)
            if self.misses >= MISSES_BEFORE_PAUSE:
                self.pause, self.misses = self.next_pause, 0
                self.next_pause = min(self.next_pause * 2, MAX_PAUSE)
            return
        self.misses = 0
        self.next_pause = FIRST_PAUSE
        self.drafts = min(self.max_drafts, accepted + 1 if accepted < drafted else self.drafts * 2)
