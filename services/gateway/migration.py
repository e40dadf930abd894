"""Request migration: what a generation carries to another (prefill, decode) pair when the decode
worker serving it fails after the first token (services/gateway/dispatcher.py decides when).

The continuation is a new Worker.Generate whose prompt is the original prompt plus every token id
already handed to the client, with the same sampling but `max_new_tokens` reduced by those tokens.
The client's stream goes on from there; the usage counts are the original request's.

Text across the boundary. The workers detokenize and match stop strings (engine/stream.py); a new
worker starts both from scratch, so on its own it would lose what the failed worker held back (the
start of a possible stop string, the bytes of a character split across tokens) and would miss a
stop string that spans the boundary. So after a migration the gateway makes the continuation's
text itself (`ContinuationText`): it replays the delivered ids through an incremental detokenizer
(the tokenizers library's DecodeStream, the same prefix/read-offset method as the workers', with
the same prompt context), keeps the text the failed worker had not sent yet, and matches the stop
strings over that text and everything after it. A stop string found here ends the stream with
finish_reason "stop" (the worker is cancelled and told to abort). Without a tokenizer (tests) the
worker's text is used as it comes.

Images travel with the continuation: it is sent with the request's encoded images again
(dispatcher.py passes them to every attempt), and its prompt still holds one image-pad token per
image, so the new worker expands and embeds them as the first one did; the delivered tokens after
them get the M-RoPE positions decoding gave them. (A delivered id that is itself an image-pad token
makes the continuation's prompt disagree with its images: the worker refuses it with 400.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from protos.v1 import common_pb2

if TYPE_CHECKING:
    from services.gateway.dispatcher import GenerationChunk

# The worker's max_new_tokens when the request leaves it unset (common.proto: SamplingParams).
WORKER_DEFAULT_MAX_NEW_TOKENS = 128
# Prompt ids the workers' detokenizer keeps as left context (engine/stream.py _PROMPT_CONTEXT).
PROMPT_CONTEXT = 6
_INCOMPLETE = "\ufffd"


def continuation_sampling(sampling: common_pb2.SamplingParams, generated: int) -> common_pb2.SamplingParams | None:
    """`sampling` for the rest of a generation that has `generated` tokens already; None when its
    token budget is spent. Everything else (stop strings and ids, ignore_eos, logprobs, seed) is
    kept; SamplingParams has no min_tokens to reduce."""
    budget = sampling.max_new_tokens if sampling.HasField("max_new_tokens") else WORKER_DEFAULT_MAX_NEW_TOKENS
    if budget - generated <= 0:
        return None
    rest = common_pb2.SamplingParams()
    rest.CopyFrom(sampling)
    rest.max_new_tokens = budget - generated
    return rest


@dataclass
class Delivered:
    """What one generation has handed to the client so far."""

    token_ids: list[int]
    text: str = ""

    def add(self, chunk: GenerationChunk) -> None:
        self.token_ids.extend(token.token_id for token in chunk.tokens)
        self.text += chunk.text


class StopStrings:
    """Stop strings over text that arrives in pieces: `feed` returns the text that can be shown
    and whether a stop string ended it; text that may begin a stop string waits in `pending`."""

    def __init__(self, stop: Sequence[str], pending: str = "") -> None:
        self.stop = tuple(stop)
        self.pending = pending
        self.stopped = False

    def feed(self, piece: str) -> tuple[str, bool]:
        text = self.pending + piece
        hits = [at for at in (text.find(s) for s in self.stop) if at >= 0]
        if hits:
            self.pending, self.stopped = "", True
            return text[:min(hits)], True
        held = max((n for s in self.stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        self.pending = text[len(text) - held:] if held else ""
        return text[:len(text) - held], False


class ContinuationText:
    """The text of a migrated generation's tokens, made as the first worker would have made it.

    Built from the original prompt and what was delivered; `apply(chunk)` gives each token of a
    continuation chunk its text (and cuts the chunk at a stop string, finish_reason "stop")."""

    def __init__(self, tokenizer: Tokenizer, sampling: common_pb2.SamplingParams, prompt_ids: Sequence[int],
                 delivered: Delivered) -> None:
        self._tokenizer = tokenizer
        context = list(prompt_ids[-PROMPT_CONTEXT:])
        if tokenizer.decode(context, skip_special_tokens=True).endswith(_INCOMPLETE):
            context = []  # as the workers do: a prompt ending inside a character gives no context
        self._stream = DecodeStream(ids=context, skip_special_tokens=True)
        self._undecoded: list[int] = []  # ids whose text the stream still holds back
        replayed = "".join(self._step(token_id) for token_id in delivered.token_ids)
        # what the failed worker produced but held back: the start of a possible stop string
        held = replayed[len(delivered.text):] if replayed.startswith(delivered.text) else ""
        self._stops = StopStrings(sampling.stop, held)
        self._stop_token_ids = frozenset(sampling.stop_token_ids)

    def _step(self, token_id: int) -> str:
        self._undecoded.append(token_id)
        piece = self._stream.step(self._tokenizer, token_id)
        if piece is None:
            return ""
        self._undecoded.clear()
        return piece

    def _flush(self) -> str:
        """Text still held back at the end (an incomplete character shows as U+FFFD, as the
        workers flush it)."""
        rest = self._tokenizer.decode(self._undecoded, skip_special_tokens=True) if self._undecoded else ""
        self._undecoded.clear()
        text, _ = self._stops.feed(rest)
        if self._stops.stopped:
            return text
        text, self._stops.pending = text + self._stops.pending, ""
        return text

    def apply(self, chunk: GenerationChunk) -> GenerationChunk:
        """`chunk` with the gateway's text for its tokens; cut after the token that completes a
        stop string (finish_reason "stop"). The worker's last token of a "stop" finish that is a
        stop token id adds no text (eos, a special token, decodes to none anyway)."""
        tokens = []
        for position, token in enumerate(chunk.tokens):
            last = position == len(chunk.tokens) - 1
            if last and chunk.finish_reason == "stop" and token.token_id in self._stop_token_ids:
                text = self._flush()
            else:
                text, _ = self._stops.feed(self._step(token.token_id))
                if last and chunk.finish_reason is not None and not self._stops.stopped:
                    text += self._flush()
            tokens.append(replace(token, text=text))
            if self._stops.stopped:
                return replace(chunk, tokens=tuple(tokens), finish_reason="stop")
        return replace(chunk, tokens=tuple(tokens))
