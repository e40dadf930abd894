"""Incremental detokenization: token ids in, newly completed text out.

Decoding the whole output every step costs O(length) per token; decoding one token alone is
wrong for byte-level tokenizers (a character's UTF-8 bytes can span tokens) and for tokenizers
whose text depends on the previous token (SentencePiece's leading spaces). So each step decodes
a small window, `prefix_offset:` (last emitted boundary before the previous one) to the end, and
emits what it adds beyond the decode of `prefix_offset:read_offset`. While the window's text ends
in U+FFFD a character is still incomplete and nothing is emitted (the same method as vLLM and
HF text-generation-inference).

Contract: the concatenation of every `push` result and `flush()` equals
`tokenizer.decode(generated_ids, skip_special_tokens=True)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.sampling import SamplingParams
from engine.stop import StopChecker

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as left context: enough for a tokenizer to place spaces right at the start.
_PROMPT_CONTEXT = 6


class IncrementalDetokenizer:
    """Turns a request's generated token ids into text, one token at a time.

    `tokenizer` is anything with `decode(ids, skip_special_tokens=True) -> str` (a transformers
    tokenizer or a `tokenizers.Tokenizer`). Call `push` per generated token, then `flush` once.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        context = list(prompt_ids[-_PROMPT_CONTEXT:])
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            # A prompt given as ids may end inside a character; its completion would then be
            # attributed to the prompt, so start the output without context instead.
            context = []
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

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


class TextStream:
    """Per-request text output: detokenization plus stop conditions, as the engine loop uses it.

    The engine calls `push(token_id)` for every sampled token and forwards the returned delta;
    once it returns stopped=True the request is finished (reason "stop") and `push` must not be
    called again. When a request ends for another reason (length, abort) the engine calls
    `flush()` for the held-back text. Stop conditions:
    - a `params.stop` string in the text: the text is cut before it (`matched_stop` names it);
    - a token in `params.stop_token_ids`, or in `eos_token_ids` unless `params.ignore_eos`: the
      token's own text is not emitted (`matched_stop` is the token id).
    Text that might be the start of a stop string is held back until it is known not to be.
    """

    def __init__(self, tokenizer: Any, params: SamplingParams, prompt_ids: Sequence[int] = (),
                 eos_token_ids: Sequence[int] = ()) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._stop = StopChecker(params.stop)
        self._stop_token_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(eos_token_ids))
        self.finished = False
        self.matched_stop: str | int | None = None  # the stop string or token id that ended the output

    @property
    def stopped(self) -> bool:
        """Whether a stop condition ended the output (finish reason "stop")."""
        return self.matched_stop is not None

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add one sampled token; return (text to emit now, whether the request stops here)."""
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

    def _finish(self) -> str:
        self.finished = True
        text, found = self._stop.push(self._detokenizer.flush())
        if found:
            self.matched_stop = self._stop.matched
            return text
        return text + self._stop.flush()
