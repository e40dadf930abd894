"""Reasoning parsers, by SGLang's --reasoning-parser names: each splits a thinking model's text into
the thinking (`reasoning_content`) and the answer (`content`).

`split(text, final)` runs over a choice's whole text so far and is monotone (a longer text extends
both parts), so streaming sends the differences; with `final=False` a suffix that may be the start
of the end tag is held back. A thinking that never ends is all reasoning (the answer was cut off).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.gateway.tool_parsers.json_scan import held_back, skip_whitespace


@dataclass(frozen=True)
class ReasoningFormat:
    """`start`/`end`: the tags around the thinking. `always_thinks`: the model's answer begins inside
    the thinking whatever the request says (DeepSeek-R1, whose template opens it in the prompt);
    otherwise it thinks unless the request turns thinking off (`enable_thinking: false`, Qwen3's
    chat template switch), and the answer is thinking only if it opens with `start` or the prompt
    ended with it."""

    start: str = "<think>"
    end: str = "</think>"
    always_thinks: bool = False

    def for_request(self, enable_thinking: object, prompt_tail: str) -> ReasoningSplit | None:
        """The split for one request (None: this request does not think), given the request's
        `chat_template_kwargs.enable_thinking` (None when absent) and the prompt's last text."""
        if not self.always_thinks and enable_thinking is False:
            return None
        opened = self.always_thinks or prompt_tail.rstrip().endswith(self.start)
        return ReasoningSplit(self, opened)


@dataclass(frozen=True)
class ReasoningSplit:
    """One request's reasoning split; `opened`: the thinking is open when the answer begins."""

    format: ReasoningFormat
    opened: bool

    @property
    def end(self) -> str:
        """The text after which the answer (and a structured output's constraint) begins."""
        return self.format.end

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of the text so far."""
        start_tag, end_tag = self.format.start, self.format.end
        first = skip_whitespace(text, 0)
        if text.startswith(start_tag, first):
            body = first + len(start_tag)
        elif not final and start_tag.startswith(text[first:]):
            return "", ""  # the start tag may be arriving
        elif self.opened:
            body = 0
        else:
            return "", text
        end = text.find(end_tag, body)
        if end < 0:
            thinking = text[body:] if final else text[body:len(text) - held_back(text[body:], end_tag)]
            return thinking.lstrip(), ""
        return text[body:end].lstrip(), text[end + len(end_tag):].lstrip()


REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "deepseek-r1": ReasoningFormat(always_thinks=True),
    "qwen3": ReasoningFormat(),
    "qwen3-thinking": ReasoningFormat(always_thinks=True),
}
