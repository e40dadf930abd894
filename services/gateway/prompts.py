"""The prompt side of a request: a checkpoint's tokenizer and chat template, and turning request
bodies into prompt token ids that fit the model.

ModelFiles reads what the gateway needs from a checkpoint folder: tokenizer, chat template, context
length, vocabulary size. Only `tokenizers`, jinja2 and json: no transformers (it would import
torch). Chat prompts are encoded without special tokens (the template already wrote them, as
apply_chat_template does); completion prompts with them (the tokenizer's post-processor may add a
BOS, as HF's __call__ does).

ChatTemplate renders a checkpoint's own chat template with jinja2, the way transformers'
apply_chat_template does: the same environment (ImmutableSandboxedEnvironment with trim_blocks and
lstrip_blocks, the loopcontrols extension, a `{% generation %}` block rendered as its body, the
`tojson` filter that keeps non-ASCII characters, the `raise_exception` / `strftime_now` globals).
The template sees `messages`, `tools`, `documents`, `add_generation_prompt`, the special tokens
(`bos_token`, `eos_token`, ...) and any extra `chat_template_kwargs` (e.g. `enable_thinking`).

PromptEncoder runs chat templating and tokenization in a small thread pool, so a big prompt never
stalls /health or other clients' streams: jinja2 holds the GIL only for as long as the template
takes over text the body limit bounds, and the tokenizer's batch call releases it. A text that
cannot fit the context whatever its tokens (ModelFiles.min_tokens) is refused before tokenizing.
The `check_*` functions refuse (400, naming the field) token ids outside the vocabulary and
prompts or token budgets beyond the context.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from services.common.model_info import context_length
from services.gateway.errors import GatewayError, bad_request
from services.gateway.marker_tokens import special_token_ids
from services.gateway.protocol import ChatCompletionRequest

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing.TypeIs is Python 3.13's

T = TypeVar("T")


# -- chat template ------------------------------------------------------------------------------

class ChatTemplateError(ValueError):
    """The template refused the conversation (its own raise_exception) or failed to render."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format_: str) -> str:
    return datetime.now().strftime(format_)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; for inference it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One compiled chat template plus the special-token variables it is rendered with."""

    def __init__(self, source: str, special_tokens: Mapping[str, Any] | None = None) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            raise ValueError(f"chat template does not compile: {exc}") from exc

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None,
               documents: Sequence[Mapping[str, Any]] | None = None,
               extra: Mapping[str, Any] | None = None) -> str:
        """The prompt text for `messages`. Raises ChatTemplateError when the template rejects them."""
        variables = {**self.special_tokens, **(extra or {})}
        try:
            return self._template.render(messages=list(messages), tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template rejected the messages: {exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(f"chat template failed on the messages: {type(exc).__name__}: "
                                    f"{exc}") from exc


# -- model files --------------------------------------------------------------------------------

# Unicode normal forms shrink a text's UTF-8 at most about 3x (three Hangul jamo compose into one
# syllable, a letter and two combining marks into one character); 4 leaves a margin.
_NORMAL_FORMS = ("NFC", "NFD", "NFKC", "NFKD")
_NORMAL_FORM_SHRINK = 4

# The named special tokens transformers passes to chat templates (its SPECIAL_TOKENS_ATTRIBUTES).
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                        "mask_token")


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
        # a vision-language checkpoint (Qwen2-VL) takes image_url parts (services.gateway.images)
        self.multimodal = isinstance(model_config.get("vision_config"), dict)
        # the model's embedding rows (may exceed the tokenizer's vocabulary: padded checkpoints)
        vocab = model_config.get("vocab_size")
        self.vocab_size = vocab if isinstance(vocab, int) and vocab > 0 else \
            self.tokenizer.get_vocab_size(with_added_tokens=True)
        self._token_text_cache: dict[int, TokenText] = {}
        # text -> id of the tokens output text skips (services.gateway.marker_tokens)
        self.special_token_ids = special_token_ids(self.tokenizer)
        self._bytes_per_token_bound = _bytes_per_token_bound(json.loads(self.tokenizer.to_str()))

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_many(self, texts: Sequence[str], *, add_special_tokens: bool) -> list[list[int]]:
        """Token ids of each text. `encode_batch` releases the GIL while it works (plain `encode`
        holds it: 5 s for 8 MB of text, with every other thread of the process stopped)."""
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [encoding.ids for encoding in encodings]

    def min_tokens(self, text: str) -> int:
        """A lower bound on the number of tokens `text` encodes to, without tokenizing it (0 when
        the tokenizer allows no bound). Lets a prompt far beyond the context be refused at once:
        tokenizing 8 MB of text takes seconds and about 0.9 GB of memory."""
        if self._bytes_per_token_bound is None:
            return 0
        return math.ceil(len(text) / self._bytes_per_token_bound)  # a character is at least one byte

    def text_of(self, token_ids: Sequence[int]) -> str:
        """The text of `token_ids`, special tokens included (as a chat template wrote them)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

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


# -- prompt token ids ---------------------------------------------------------------------------

# Text up to this many characters is templated and tokenized on the event loop (a few ms at most).
INLINE_CHARS = 8192


class PromptEncoder:
    """Chat templating and tokenization for request handlers, on `threads` worker threads.
    Created with the app, closed at shutdown."""

    def __init__(self, model_files: ModelFiles, threads: int) -> None:
        self.model_files = model_files
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gateway-tokenize")

    async def _run(self, work: Callable[[], T], size: int) -> T:
        # Small inputs are done inline: a thread hop costs more than they do, and the tokenizer's
        # batch call wakes its own worker threads, which compete with the workers for the cores.
        if size <= INLINE_CHARS:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self._pool, work)

    async def chat(self, body: ChatCompletionRequest, tools: list[dict[str, Any]] | None) -> list[int]:
        """Render the checkpoint's chat template over the messages and `tools` (what tool_choice lets
        the model see) and tokenize (no special tokens added: the template wrote them)."""
        template = self.model_files.chat_template
        if template is None:
            raise bad_request("this model has no chat template; use /v1/completions", param="messages")
        messages = [message.template_dict() for message in body.messages]

        def render() -> str:
            return template.render(messages, add_generation_prompt=body.add_generation_prompt,
                                   tools=tools, extra=body.chat_template_kwargs)

        size = sum(len(str(message.get("content", ""))) for message in messages) + len(str(tools or ""))
        try:
            text = await self._run(render, size)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), param="messages") from None
        return (await self._encode([text], add_special_tokens=False, param="messages"))[0]

    async def prompts(self, prompt: str | list[str] | list[int] | list[list[int]],
                      param: str) -> list[list[int]]:
        """The prompts of a /v1/completions (or /generate) body as token id lists."""
        if isinstance(prompt, str):
            return await self._encode([prompt], add_special_tokens=True, param=param)
        if _all_texts(prompt):
            return await self._encode(prompt, add_special_tokens=True, param=param)
        if _flat_ids(prompt):
            return [prompt]
        return list(prompt)

    async def _encode(self, texts: Sequence[str], *, add_special_tokens: bool, param: str) -> list[list[int]]:
        context = self.model_files.context_length
        if context is not None:
            for text in texts:
                at_least = self.model_files.min_tokens(text)
                if at_least >= context:
                    raise context_exceeded(context, f"at least {at_least}", param)
        size = sum(len(text) for text in texts)
        if size <= INLINE_CHARS:
            return [self.model_files.encode(text, add_special_tokens=add_special_tokens) for text in texts]
        return await self._run(
            lambda: self.model_files.encode_many(texts, add_special_tokens=add_special_tokens), size)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _all_texts(prompt: list[str] | list[int] | list[list[int]]) -> TypeIs[list[str]]:
    return all(isinstance(item, str) for item in prompt)


def _flat_ids(prompt: list[int] | list[list[int]]) -> TypeIs[list[int]]:
    # validation left only all-int or all-list id prompts: the first item says which
    return isinstance(prompt[0], int)


def context_exceeded(context: int, prompt_tokens: int | str, param: str) -> GatewayError:
    return bad_request(
        f"This model's maximum context length is {context} tokens. However, your prompt has "
        f"{prompt_tokens} tokens. Please reduce the length of the prompt.",
        param=param, code="context_length_exceeded")


def check_prompt(prompt_ids: Sequence[int], max_new_tokens: int | None, model_files: ModelFiles,
                 param: str, max_tokens_param: str = "max_tokens") -> None:
    """400 for an empty prompt, token ids outside the vocabulary, or a prompt (plus the tokens
    asked for) longer than the model's context, naming both lengths."""
    if not prompt_ids:
        raise bad_request("the prompt is empty (no tokens)", param=param)
    context = model_files.context_length
    if context is not None and len(prompt_ids) >= context:  # before the id scan: it costs per id
        raise context_exceeded(context, len(prompt_ids), param)
    check_token_ids(prompt_ids, model_files, param)
    if context is None:
        return
    if max_new_tokens is not None and len(prompt_ids) + max_new_tokens > context:
        raise bad_request(
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{len(prompt_ids) + max_new_tokens} tokens ({len(prompt_ids)} in the prompt, {max_new_tokens} "
            f"for the completion). Please reduce the length of the prompt or the completion.",
            param=max_tokens_param, code="context_length_exceeded")


def check_max_tokens(max_new_tokens: int | None, model_files: ModelFiles, param: str) -> None:
    """400 naming `param` for a token budget no prompt leaves room for (the prompt takes at least
    one token of the context), before anything is tokenized."""
    context = model_files.context_length
    if max_new_tokens is not None and context is not None and max_new_tokens >= context:
        raise bad_request(f"{param} is {max_new_tokens}, but this model's maximum context length is "
                          f"{context} tokens, prompt included", param=param, code="context_length_exceeded")


def check_token_ids(token_ids: Sequence[int], model_files: ModelFiles, param: str) -> None:
    """400 naming `param` if a token id is outside the model's vocabulary."""
    vocab_size = model_files.vocab_size
    bad = next((token for token in token_ids if not 0 <= token < vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})", param=param)
