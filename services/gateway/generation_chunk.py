"""What the gateway makes of each message of a worker's Generate stream: GenerationChunk, and its
tokens as GeneratedToken (built only when asked for)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class GeneratedToken(NamedTuple):
    """One sampled token as the worker sent it: id, the text it completed, logprobs if asked. A named
    tuple, not a frozen dataclass: one is made per relayed token, and a tuple is made at about half
    the cost."""

    token_id: int
    text: str
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


class GenerationChunk:
    """Tokens of one worker message; the last chunk has `finish_reason` and the usage counts.

    Made once per relayed message, so it is cheap to make: the token ids and their texts are kept as
    the worker's columns (GenerateResponse.token_ids/token_texts), their text joined once (the
    response side reads it several times per chunk), and the GeneratedToken objects are built only
    when something asks for `tokens` (logprobs, a whole response's tokens), or given when the
    message carried logprobs."""

    __slots__ = ("token_ids", "texts", "finish_reason", "prompt_tokens", "completion_tokens", "text",
                 "_tokens")

    def __init__(self, tokens: Sequence[GeneratedToken] | None = None, finish_reason: str | None = None,
                 prompt_tokens: int = 0, completion_tokens: int = 0, *,
                 token_ids: Sequence[int] = (), texts: Sequence[str] = ()) -> None:
        if tokens is not None:
            self._tokens: tuple[GeneratedToken, ...] | None = tuple(tokens)
            token_ids = [token.token_id for token in self._tokens]
            texts = [token.text for token in self._tokens]
        else:
            self._tokens = None
        self.token_ids: Sequence[int] = token_ids
        self.texts: Sequence[str] = texts
        self.finish_reason = finish_reason
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        self.text = "".join(texts)

    @property
    def tokens(self) -> tuple[GeneratedToken, ...]:
        if self._tokens is None:
            self._tokens = tuple([GeneratedToken(token_id, text)
                                  for token_id, text in zip(self.token_ids, self.texts, strict=True)])
        return self._tokens

    def __len__(self) -> int:
        """The number of tokens."""
        return len(self.token_ids)

    def with_usage(self, prompt_tokens: int, completion_tokens: int) -> GenerationChunk:
        return GenerationChunk(self._tokens, self.finish_reason, prompt_tokens, completion_tokens,
                               token_ids=self.token_ids, texts=self.texts)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GenerationChunk):
            return NotImplemented
        return (self.tokens, self.finish_reason, self.prompt_tokens, self.completion_tokens) == \
            (other.tokens, other.finish_reason, other.prompt_tokens, other.completion_tokens)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"GenerationChunk(tokens={self.tokens!r}, finish_reason={self.finish_reason!r}, "
                f"prompt_tokens={self.prompt_tokens}, completion_tokens={self.completion_tokens})")
