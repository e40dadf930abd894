"""What the gateway reads from a checkpoint folder: tokenizer, chat template, context length.

Only `tokenizers`, jinja2 and json: no transformers (it would import torch). Chat prompts are
encoded without special tokens (the template already wrote them, as apply_chat_template does);
completion prompts with them (the tokenizer's post-processor may add a BOS, as HF's __call__ does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from services.gateway.chat_template import ChatTemplate

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
        self.context_length = self._context_length(model_config, tokenizer_config)
        # the model's embedding rows (may exceed the tokenizer's vocabulary: padded checkpoints)
        vocab = model_config.get("vocab_size")
        self.vocab_size = vocab if isinstance(vocab, int) and vocab > 0 else \
            self.tokenizer.get_vocab_size(with_added_tokens=True)
        self._token_text_cache: dict[int, TokenText] = {}

    @staticmethod
    def _context_length(model_config: dict[str, Any], tokenizer_config: dict[str, Any]) -> int | None:
        for source, key in ((model_config, "max_position_embeddings"), (model_config, "max_sequence_length"),
                            (model_config, "seq_length"), (tokenizer_config, "model_max_length")):
            value = source.get(key)
            # tokenizer_config's "no limit" is a huge sentinel (int(1e30)), not a real length
            if isinstance(value, int) and 0 < value < 10**9:
                return value
        return None

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

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
