"""Which of the text parsers' markers the worker must keep in the output text.

Workers decode output with special tokens skipped, so a marker the tokenizer makes a special token
(Qwen's `<tool_call>` in some tokenizers, DeepSeek's `<｜tool▁calls▁begin｜>`, Mistral's
`[TOOL_CALLS]` and `[ARGS]`) never reaches the gateway's parser. A request read by a tool call
parser (or a reasoning parser) therefore names those tokens in
SamplingParams.kept_special_token_ids; the worker keeps their text and skips every other special
token as before, so the output of a request with no parser is unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping

from tokenizers import Tokenizer

from services.gateway.reasoning_parsers import REASONING_PARSERS
from services.gateway.tool_parsers import TOOL_CALL_MARKERS


def special_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """The tokenizer's special tokens, text -> id (the tokens `skip_special_tokens` drops)."""
    return {token.content: token_id for token_id, token in tokenizer.get_added_tokens_decoder().items()
            if token.special}


def kept_marker_ids(specials: Mapping[str, int], tool_call_parser: str | None,
                    reasoning_parser: str | None) -> tuple[int, ...]:
    """The ids of the parsers' markers that are special tokens in this tokenizer."""
    markers = list(TOOL_CALL_MARKERS.get(tool_call_parser or "", ()))
    if reasoning_parser:
        reasoning = REASONING_PARSERS[reasoning_parser]
        markers += [reasoning.start, reasoning.end]
    return tuple(sorted({specials[marker] for marker in markers if marker in specials}))
