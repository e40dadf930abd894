"""Stop strings over streamed text."""

from __future__ import annotations

from collections.abc import Sequence


class StopChecker:
    """Finds stop strings in text that arrives in pieces, without ever emitting part of one.

    Feed each new piece of output text to `push`; it returns the text that is safe to emit and
    whether a stop string was found. On a match the output is cut before the earliest stop string
    (`matched` names it) and everything after it is dropped. Otherwise the longest tail that is the
    beginning of some stop string is held back, because the next piece may complete it; `flush`
    returns that tail when the output ends without a match.

    Why a match can only start inside held + new text: text emitted earlier was not the start of
    any stop string, or it would have been held.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        if any(s == "" for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop = tuple(stop)
        self.matched: str | None = None
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Add `text`; return (text safe to emit, whether a stop string was found)."""
        if self.matched is not None:
            return "", True
        buffer = self._held + text
        if not self.stop:
            return buffer, False
        found = [(buffer.find(s), s) for s in self.stop]
        found = [(at, s) for at, s in found if at >= 0]
        if found:
            at, self.matched = min(found, key=lambda hit: hit[0])
            self._held = ""
            return buffer[:at], True
        keep = self._longest_stop_prefix_suffix(buffer)
        self._held = buffer[len(buffer) - keep:]
        return buffer[:len(buffer) - keep], False

    def flush(self) -> str:
        """The held-back tail, for output that ended without a stop string."""
        held, self._held = self._held, ""
        return held

    def _longest_stop_prefix_suffix(self, buffer: str) -> int:
        longest = 0
        for s in self.stop:
            for length in range(min(len(s) - 1, len(buffer)), longest, -1):
                if buffer.endswith(s[:length]):
                    longest = length
                    break
        return longest
