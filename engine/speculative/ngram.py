"""NGRAM drafting (prompt lookup): the tokens that followed the latest earlier occurrence of the
request's last few tokens, in its own prompt and output. No second model: it pays off where answers
copy their prompts (code edits, quoting, extraction) and costs one dict lookup per step elsewhere."""

from __future__ import annotations


class NgramIndex:
    """One request's n-grams (lengths min_match..max_match) -> where each last ended, kept up to
    date incrementally as the request's tokens grow (retraction keeps the tokens, so the index too)."""

    def __init__(self, min_match: int, max_match: int) -> None:
        self.min_match = min_match
        self.max_match = max_match
        self._ends: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in _ends

    def _index_until(self, tokens: list[int], end: int) -> None:
        for stop in range(self._indexed + 1, end + 1):
            for n in range(self.min_match, min(self.max_match, stop) + 1):
                self._ends[tuple(tokens[stop - n:stop])] = stop
        self._indexed = max(self._indexed, end)

    def propose(self, tokens: list[int], max_drafts: int) -> list[int]:
        """`max_drafts` tokens that followed the latest earlier occurrence of the longest suffix of
        `tokens` (max_match down to min_match long) seen before; [] when none was. Past the end of
        `tokens` the copy goes on over the drafts themselves (a copy that overlaps its source, as
        LZ77's): a request repeating a run of p tokens has its latest match p tokens back, and
        still gets a full draft of that run repeated."""
        if max_drafts <= 0 or len(tokens) < 2:
            return []
        # Occurrences that end before the last token: the suffix itself must not match itself.
        self._index_until(tokens, len(tokens) - 1)
        for n in range(min(self.max_match, len(tokens) - 1), self.min_match - 1, -1):
            end = self._ends.get(tuple(tokens[-n:]))
            if end is not None:
                drafts: list[int] = []
                for source in range(end, end + max_drafts):
                    drafts.append(tokens[source] if source < len(tokens) else drafts[source - len(tokens)])
                return drafts
        return []
