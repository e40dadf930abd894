"""DraftBudget: how many tokens one request drafts next step, from how its drafts fared.

A verify row costs more than a decode row only by its extra positions, but a drafter that is never
right pays that every step. So the budget follows the accepted length (draft one more than was
last accepted, up to the most), and after a run of verifies that accepted nothing it stops drafting
for a pause that doubles each time it happens again (up to MAX_PAUSE steps): a drafter that is
never right then verifies once per MAX_PAUSE steps, a few drafts at a time.
"""

from __future__ import annotations

MISSES_BEFORE_PAUSE = 2
FIRST_PAUSE = 4
MAX_PAUSE = 128


class DraftBudget:
    """Per request; `next()` before drafting, `record()` after its verify."""

    def __init__(self, max_drafts: int) -> None:
        self.max_drafts = max_drafts
        self.drafts = max_drafts
        self.misses = 0  # verifies in a row that accepted nothing
        self.pause = 0  # steps left without drafting
        self.next_pause = FIRST_PAUSE

    def next(self) -> int:
        """Drafts allowed this step (0: decode one token without drafting)."""
        if self.pause > 0:
            self.pause -= 1
            return 0
        return self.drafts

    def record(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
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
