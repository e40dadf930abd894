"""A request's output text: incremental detokenization and stop conditions, made the same way
wherever it is made.

A worker makes the text of the tokens it samples (engine/stream.py, on the caller's loop); after a
migration the gateway makes the text of the continuation's tokens itself
(services/gateway/migration.py), replaying the tokens already delivered through a `TextStream` so
that it holds exactly what the failed worker held (the start of a possible stop string, the bytes
of a character split across tokens). Both use this module, so the two texts cannot drift apart.
Torch-free: the gateway imports it.

Incremental detokenization: token ids in, newly completed text out. Decoding the whole output
every step costs O(length) per token; decoding one token alone is wrong for byte-level tokenizers
(a character's UTF-8 bytes can span tokens) and for tokenizers whose text depends on the previous
token (SentencePiece's leading spaces). So each step decodes a small window, `prefix_offset:` (last
emitted boundary before the previous one) to the end, and emits what it adds beyond the decode of
`prefix_offset:read_offset`. While the window's text ends in U+FFFD a character is still
incomplete and nothing is emitted (the same method as vLLM and HF text-generation-inference).
Contract: the concatenation of every `push` result and `flush()` equals
`tokenizer.decode(generated_ids, skip_special_tokens=True)`, except that the special tokens in
`kept_special_ids` (a tool call parser's markers, which the gateway must see) keep their text: the
ids around each such token are decoded as above, its own text is put between them.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as left context: enough for a tokenizer to place spaces right at the start.
PROMPT_CONTEXT = 6


class Decoder(Protocol):
    """What the text needs of a tokenizer: a transformers tokenizer or a `tokenizers.Tokenizer`."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns a request's generated token ids into text, one token at a time.

    Call `push` per generated token, then `flush` once. `prompt_ids`: the prompt, whose last
    PROMPT_CONTEXT tokens are the left context of the first generated token.
    """

    def __init__(self, tokenizer: Decoder, prompt_ids: Sequence[int] = (),
                 kept_special_ids: Collection[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._kept = frozenset(kept_special_ids)
        context = list(prompt_ids[-PROMPT_CONTEXT:])
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            # A prompt given as ids may end inside a character; its completion would then be
            # attributed to the prompt, so start the output without context instead.
            context = []
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    def _decode(self, ids: list[int]) -> str:
        if not self._kept or self._kept.isdisjoint(ids):
            return self._tokenizer.decode(ids, skip_special_tokens=True)
        parts: list[str] = []
        run: list[int] = []
        for token_id in ids:
            if token_id in self._kept:
                parts.append(self._tokenizer.decode(run, skip_special_tokens=True) if run else "")
                parts.append(self._tokenizer.decode([token_id], skip_special_tokens=False))
                run = []
            else:
                run.append(token_id)
        parts.append(self._tokenizer.decode(run, skip_special_tokens=True) if run else "")
        return "".join(parts)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is incomplete)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text):]
        # Drop ids left of the new window so the list stays short however long the output gets.
        del self._ids[:self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        return delta

    def flush(self) -> str:
        """Text still held back at the end (an incomplete character decodes to U+FFFD here, as it
        does in a full decode)."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]


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
        found = [(at, s) for at, s in ((buffer.find(s), s) for s in self.stop) if at >= 0]
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


class TextStream:
    """One request's output text: detokenization plus stop conditions.

    `push(token_id)` is called for every sampled token and its delta forwarded; once it returns
    stopped=True the output is finished (reason "stop") and `push` must not be called again. When
    the output ends for another reason (length, abort) `flush()` gives the held-back text. Stop
    conditions:
    - a `stop` string in the text: the text is cut before it (`matched_stop` names it);
    - a token in `stop_token_ids` (the caller adds the model's eos ids unless the request ignores
      eos): the token's own text is not emitted (`matched_stop` is the token id).
    Text that might be the start of a stop string is held back until it is known not to be.
    """

    def __init__(self, tokenizer: Decoder, stop: Sequence[str] = (), stop_token_ids: Collection[int] = (),
                 prompt_ids: Sequence[int] = (), kept_special_ids: Collection[int] = ()) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, kept_special_ids)
        self._stop = StopChecker(stop)
        self._stop_token_ids = frozenset(stop_token_ids)
        self.finished = False
        self.matched_stop: str | int | None = None  # the stop string or token id that ended the output

    @property
    def stopped(self) -> bool:
        """Whether a stop condition ended the output (finish reason "stop")."""
        return self.matched_stop is not None

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add one sampled token; return (text to emit now, whether the output stops here)."""
        if self.finished:
            raise RuntimeError("TextStream.push after the output finished")
        if token_id in self._stop_token_ids:
            self.matched_stop = token_id
            return self._finish(), True
        delta, found = self._stop.push(self._detokenizer.push(token_id))
        if found:
            self.matched_stop = self._stop.matched
            self.finished = True
        return delta, found

    def flush(self) -> str:
        """All text still held back, for an output that ends without a stop condition (length,
        abort); a stop string completed by the held-back text still cuts it."""
        if self.finished:
            return ""
        return self._finish()

    def apply(self, token_id: int, finish_reason: str | None) -> tuple[str, str | None, bool]:
        """One token as its producer reported it, with its finish reason (None: not finished).
        Returns its text (plus the held-back text when the output ends here), the finish reason
        ("stop" when a stop condition ends the output at this token) and whether that stop is news
        to the producer (it did not end the output itself, so it must be told). Past a stop
        condition, later tokens get no text."""
        if self.finished:
            return "", finish_reason, False
        delta, stopped = self.push(token_id)
        if finish_reason is not None and not stopped:
            delta += self.flush()
        return delta, "stop" if stopped else finish_reason, stopped and finish_reason is None

    def _finish(self) -> str:
        self.finished = True
        text, found = self._stop.push(self._detokenizer.flush())
        if found:
            self.matched_stop = self._stop.matched
            return text
        return text + self._stop.flush()
