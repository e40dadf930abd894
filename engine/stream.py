"""The caller's side of a request: its stream of outputs, and that stream's text.

The engine thread emits token ids and ends a request on token-level conditions (a stop token,
eos, length); everything about text happens here, on the caller's loop: `OutputStream` receives
what the engine delivered, gives each token its text (`TextStream`) and tells the engine to finish
a request whose stop string it found. A prefill-only request has no text and builds none of this
but the stream.

Incremental detokenization: token ids in, newly completed text out. Decoding the whole output
every step costs O(length) per token; decoding one token alone is wrong for byte-level tokenizers
(a character's UTF-8 bytes can span tokens) and for tokenizers whose text depends on the previous
token (SentencePiece's leading spaces). So each step decodes a small window, `prefix_offset:` (last
emitted boundary before the previous one) to the end, and emits what it adds beyond the decode of
`prefix_offset:read_offset`. While the window's text ends in U+FFFD a character is still
incomplete and nothing is emitted (the same method as vLLM and HF text-generation-inference).
Contract: the concatenation of every `push` result and `flush()` equals
`tokenizer.decode(generated_ids, skip_special_tokens=True)`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any

from engine.outputs import TokenOutput
from engine.sampling import SamplingParams

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


class TextStream:
    """Per-request text output: detokenization plus stop conditions, as `OutputStream` uses it.

    `push(token_id)` is called for every sampled token and its delta forwarded; once it returns
    stopped=True the request is finished (reason "stop") and `push` must not be called again. When
    a request ends for another reason (length, abort) `flush()` gives the held-back text (`apply`
    does both for one engine output). Stop conditions:
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

    def apply(self, output: TokenOutput) -> tuple[TokenOutput, bool]:
        """The output with its token's text; True when a stop string ends the output at this token
        although the engine did not end it (so the engine must be told)."""
        if self.finished:  # past a stop string: the caller has already returned
            return output, False
        delta, stopped = self.push(output.token_id)
        reason = "stop" if stopped else output.finish_reason
        if reason is not None and not stopped:
            delta += self.flush()
        return replace(output, text=delta, finish_reason=reason), stopped and output.finish_reason is None


class OutputStream:
    """The caller's end of one request (the threading protocol in engine.engine).

    The engine thread hands each output to `put` on the caller's loop (`loop.call_soon_threadsafe`,
    once per step); `batches` yields them, everything queued when the caller looks as one list, so
    a caller that fell behind gets what piled up as one item (one message for a server to send).
    With a `text`, each token gets its text here, and a stop string found here is reported through
    `on_stop_string` so the engine finishes the request. An exception put here (the engine refused
    the request) is raised. `done`: the last output or the refusal came through, so a caller that
    leaves now leaves nothing running.
    """

    def __init__(self, text: TextStream | None) -> None:
        self.loop = asyncio.get_running_loop()
        self._outputs: asyncio.Queue[TokenOutput | Exception] = asyncio.Queue()
        self.put: Callable[[TokenOutput | Exception], None] = self._outputs.put_nowait
        self.text = text
        self.done = False

    async def batches(self, on_stop_string: Callable[[], None]) -> AsyncIterator[list[TokenOutput]]:
        while not self.done:
            batch = []
            item = await self._outputs.get()
            while True:
                if isinstance(item, Exception):
                    self.done = True
                    raise item
                if self.text is not None and item.token_id >= 0:
                    item, stopped_here = self.text.apply(item)
                    if stopped_here:  # a stop string: the engine does not know yet
                        on_stop_string()
                batch.append(item)
                self.done = item.finish_reason is not None
                if self.done or self._outputs.empty():
                    break
                item = self._outputs.get_nowait()
            yield batch
