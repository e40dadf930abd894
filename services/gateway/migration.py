"""Request migration: what a generation carries to another (prefill, decode) pair when the decode
worker serving it fails after the first token (services/gateway/dispatcher.py decides when).

The continuation is a new Worker.Generate whose prompt is the original prompt plus every token id
already handed to the client, with the same sampling but `max_new_tokens` reduced by those tokens.
The client's stream goes on from there; the usage counts are the original request's.

Text across the boundary. The workers detokenize and match stop strings (pdserve/text.py, through
engine/stream.py); a new worker starts both from scratch, so on its own it would lose what the
failed worker held back (the start of a possible stop string, the bytes of a character split
across tokens) and would miss a stop string that spans the boundary. So after a migration the
gateway makes the continuation's text itself (`ContinuationText`) with the workers' own
`TextStream`: replaying the delivered ids through it leaves it holding exactly what the failed
worker held, and the continuation's tokens go on from there. A stop string found here ends the
stream with finish_reason "stop" (the worker is cancelled and told to abort). Without a tokenizer
(tests) the worker's text is used as it comes.

Images travel with the continuation: it is sent with the request's encoded images again
(dispatcher.py passes them to every attempt), and its prompt still holds one image-pad token per
image, so the new worker expands and embeds them as the first one did; the delivered tokens after
them get the M-RoPE positions decoding gave them. (A delivered id that is itself an image-pad token
makes the continuation's prompt disagree with its images: the worker refuses it with 400.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.sampling_params import DEFAULT_MAX_NEW_TOKENS
from pdserve.text import Decoder, TextStream
from protos.v1 import common_pb2
from services.gateway.generation_chunk import GenerationChunk


def continuation_sampling(sampling: common_pb2.SamplingParams,
                          generated: int) -> common_pb2.SamplingParams | None:
    """`sampling` for the rest of a generation that has `generated` tokens already; None when its
    token budget is spent. min_tokens is reduced likewise; everything else (stop strings and ids,
    ignore_eos, logprobs, seed, penalties, structured output) is kept: the worker continues the
    penalty counts and the grammar from the carried tokens (GenerateRequest.carried_tokens)."""
    budget = sampling.max_new_tokens if sampling.HasField("max_new_tokens") else DEFAULT_MAX_NEW_TOKENS
    if budget - generated <= 0:
        return None
    rest = common_pb2.SamplingParams()
    rest.CopyFrom(sampling)
    rest.max_new_tokens = budget - generated
    rest.min_tokens = max(0, sampling.min_tokens - generated)
    return rest


@dataclass
class Delivered:
    """What one generation has handed to the client so far: its token ids (their text follows
    from them, `ContinuationText`)."""

    token_ids: list[int]

    def add(self, chunk: GenerationChunk) -> None:
        self.token_ids.extend(chunk.token_ids)


class ContinuationText:
    """The text of a migrated generation's tokens, made as the first worker would have made it.

    Built from the original prompt and what was delivered; `apply(chunk)` gives each token of a
    continuation chunk its text (and cuts the chunk at a stop string, finish_reason "stop"). The
    model's eos ids are not known here and need not be: the worker ends a stream on one with
    finish_reason "stop", and an eos (a special token) decodes to no text."""

    def __init__(self, tokenizer: Decoder, sampling: common_pb2.SamplingParams, prompt_ids: Sequence[int],
                 delivered: Delivered) -> None:
        self._text = TextStream(tokenizer, sampling.stop, sampling.stop_token_ids, prompt_ids,
                                sampling.kept_special_token_ids)
        for token_id in delivered.token_ids:  # the worker's state when it failed: what it held back
            self._text.push(token_id)

    def apply(self, chunk: GenerationChunk) -> GenerationChunk:
        """`chunk` with the gateway's text for its tokens; cut after the token that completes a
        stop string (finish_reason "stop")."""
        tokens = []
        for position, token in enumerate(chunk.tokens):
            reason = chunk.finish_reason if position == len(chunk.tokens) - 1 else None
            text, reason, _ = self._text.apply(token.token_id, reason)
            tokens.append(token._replace(text=text))
            if self._text.stopped:
                return GenerationChunk(tokens, "stop", chunk.prompt_tokens, chunk.completion_tokens)
        return GenerationChunk(tokens, chunk.finish_reason, chunk.prompt_tokens, chunk.completion_tokens)
