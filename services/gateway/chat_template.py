"""Render a checkpoint's own chat template with jinja2, the way transformers' apply_chat_template does.

Same environment as transformers: ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks,
the loopcontrols extension, a `{% generation %}` block (rendered as its body), the `tojson` filter
that keeps non-ASCII characters, and the `raise_exception` / `strftime_now` globals. The template
sees `messages`, `tools`, `documents`, `add_generation_prompt`, the special tokens
(`bos_token`, `eos_token`, ...) and any extra `chat_template_kwargs` (e.g. `enable_thinking`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template refused the conversation (its own raise_exception) or failed to render."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


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
            raise ChatTemplateError(f"chat template failed on the messages: {type(exc).__name__}: {exc}") from exc
