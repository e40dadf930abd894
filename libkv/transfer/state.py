"""The state of one engine operation (a write, or a grant read), or of a write made of several."""

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

    @staticmethod
    def combined(states: list[TransferState]) -> TransferState:
        """The state of a write made of parts (one per rank or per engine connection): FAILED as
        soon as one part failed, else ABORTED if one was aborted, else PENDING while one is."""
        for state in (TransferState.FAILED, TransferState.ABORTED, TransferState.PENDING):
            if state in states:
                return state
        return TransferState.DONE
