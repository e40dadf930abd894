"""What the gateway reads from a checkpoint folder: tokenizer, chat template, context length.

Only `tokenizers`, jinja2 and json: no transformers (it would import torch). Chat prompts are
encoded without special tokens (the template already wrote them, as apply_chat_template does);
completion prompts with them (the tokenizer's post-processor may add a BOS, as HF's __call__ does).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from services.common.model_info import context_length
from services.gateway.chat_template import ChatTemplate

# Unicode normal forms shrink a text's UTF-8 at most about 3x (three Hangul jamo compose into one
# syllable, a letter and two combining marks into one character); 4 leaves a margin.
_NORMAL_FORMS = ("NFC", "NFD", "NFKC", "NFKD")
_NORMAL_FORM_SHRINK = 4

# The named special tokens transformers passes to chat templates (its SPECIAL_TOKENS_ATTRIBUTES).
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _template_source(folder: Path, tokenizer_config: dict[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _bytes_per_token_bound(spec: dict[str, Any]) -> int | None:
    """Most bytes of input text one token can stand for, if the tokenizer has such a bound.

    A BPE model that maps every byte to some token (byte-level, or byte fallback instead of an
    unknown token) covers the normalized text with tokens whose vocabulary strings are at least
    as long in UTF-8 as the bytes they cover; added tokens match their own content. A normalizer
    other than a Unicode normal form could delete text, and an unknown token could swallow any
    amount of it: then there is no bound (None)."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or (model.get("unk_token") is not None and not model.get("byte_fallback")):
        return None
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None:
        return None
    pieces = list((model.get("vocab") or {}).keys())
    pieces += [token.get("content", "") for token in spec.get("added_tokens") or []]
    longest = max((len(piece.encode("utf-8")) for piece in pieces), default=0)
    return longest * shrink if longest > 0 else None


def _normalizer_shrink(normalizer: dict[str, Any] | None) -> int | None:
    """How many times shorter the normalizer can make a text (None: unknown)."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind in _NORMAL_FORMS:
        return _NORMAL_FORM_SHRINK
    if kind == "Sequence":
        shrink = 1
        for step in normalizer.get("normalizers") or []:
            step_shrink = _normalizer_shrink(step)
            if step_shrink is None:
                return None
            shrink *= step_shrink
        return shrink
    return None


@dataclass(frozen=True)
class TokenText:
    """A token as the OpenAI logprobs fields show it: its text and the UTF-8 bytes behind it."""

    text: str
    bytes: list[int]


class ModelFiles:
    """Tokenizer, chat template and limits of one checkpoint folder. Thread-safe for reads."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.tokenizer = Tokenizer.from_file(str(self.folder / "tokenizer.json"))
        tokenizer_config = _read_json(self.folder / "tokenizer_config.json")
        model_config = _read_json(self.folder / "config.json")
        self.special_tokens = {name: text for name in _SPECIAL_TOKEN_NAMES
                               if (text := _token_text(tokenizer_config.get(name))) is not None}
        source = _template_source(self.folder, tokenizer_config)
        self.chat_template = ChatTemplate(source, self.special_tokens) if source is not None else None
        self.context_length = context_length(model_config, tokenizer_config)
        # the model's embedding rows (may exceed the tokenizer's vocabulary: padded checkpoints)
        vocab = model_config.get("vocab_size")
        self.vocab_size = vocab if isinstance(vocab, int) and vocab > 0 else \
            self.tokenizer.get_vocab_size(with_added_tokens=True)
        self._token_text_cache: dict[int, TokenText] = {}
        self._bytes_per_token_bound = _bytes_per_token_bound(json.loads(self.tokenizer.to_str()))

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_many(self, texts: Sequence[str], *, add_special_tokens: bool) -> list[list[int]]:
        """Token ids of each text. `encode_batch` releases the GIL while it works (plain `encode`
        holds it: 5 s for 8 MB of text, with every other thread of the process stopped)."""
        return [encoding.ids for encoding in self.tokenizer.encode_batch(list(texts),
                                                                         add_special_tokens=add_special_tokens)]

    def min_tokens(self, text: str) -> int:
        """A lower bound on the number of tokens `text` encodes to, without tokenizing it (0 when
        the tokenizer allows no bound). Lets a prompt far beyond the context be refused at once:
        tokenizing 8 MB of text takes seconds and about 0.9 GB of memory."""
        if self._bytes_per_token_bound is None:
            return 0
        return math.ceil(len(text) / self._bytes_per_token_bound)  # a character is at least one byte

    def token_text(self, token_id: int) -> TokenText:
        """The text of one token on its own (byte-level pieces of a multi-byte character decode to
        U+FFFD, as vLLM shows them) and its bytes."""
        cached = self._token_text_cache.get(token_id)
        if cached is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            cached = TokenText(text, list(text.encode("utf-8")))
            if len(self._token_text_cache) < 1 << 18:
                self._token_text_cache[token_id] = cached
        return cached
