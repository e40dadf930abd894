"""The state of one engine operation (a write, or a grant read); shared by base and grant_reads."""

from __future__ import annotations

import enum


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def finished(self) -> bool:
        return self is not TransferState.PENDING
