"""A chat choice's text as the OpenAI message shows it: the thinking (`reasoning_content`, with a
--reasoning-parser), the content, and the tool calls (`tool_calls`: found by the --tool-call-parser
with tool_choice auto, or read from the constrained JSON of `required` and named choices).

`ChatParsing` is one request's plan (built by `chat_parsing` from the body, the gateway's parser
names and the prompt); it adds the structured output to each choice's sampling and makes a
`ChoiceParser` per choice. A parser reads the choice's whole text so far, so the non-streamed
message is `message(text)` and a stream is `StreamedChoice.step(text so far)` after each chunk: each
part only grows (the parsers are monotone), so the pieces a stream sends assemble to the message.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel

from protos.v1 import common_pb2
from services.gateway.errors import bad_request
from services.gateway.marker_tokens import kept_marker_ids
from services.gateway.reasoning_parsers import REASONING_PARSERS, ReasoningSplit
from services.gateway.tool_choice import ToolPlan
from services.gateway.tool_parsers import TOOL_CALL_PARSERS, ToolCallParse
from services.gateway.tool_parsers.json_scan import (
    JsonScanner,
    NotACall,
    ScannedCall,
    scan_call_array,
    skip_whitespace,
)

# -- wire shapes --------------------------------------------------------------------------------


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A piece of a streamed tool call: `id`, `type` and the name in its first piece only, then
    arguments text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# -- parsing ------------------------------------------------------------------------------------


@dataclass
class MessageParts:
    reasoning: str = ""
    content: str = ""
    calls: list[ScannedCall] = field(default_factory=list)


class ChoiceParser:
    """Splits one choice's text (see the module doc). `reasoning`: this request's split, or None;
    `plan`: its tools; `parse_tools`: the --tool-call-parser, for tool_choice auto."""

    def __init__(self, reasoning: ReasoningSplit | None, plan: ToolPlan, parse_tools: ToolCallParse | None):
        self.reasoning = reasoning
        self.plan = plan
        self.parse_tools = parse_tools if plan.mode == "auto" else None
        self.scanner = JsonScanner()

    @property
    def plain(self) -> bool:
        """True when the text is all content (no parsing needed)."""
        return (self.reasoning is None and self.parse_tools is None
                and self.plan.mode not in ("required", "named"))

    def parse(self, text: str, final: bool) -> MessageParts:
        reasoning, answer = self.reasoning.split(text, final) if self.reasoning is not None else ("", text)
        parts = MessageParts(reasoning=reasoning)
        if self.plan.mode == "named":
            parts.content, parts.calls = _named_call(self.plan.function or "", answer, final)
        elif self.plan.mode == "required":
            parts.content, parts.calls = _required_calls(answer, final, self.scanner)
        elif self.parse_tools is not None:
            parsed = self.parse_tools(answer, final, self.scanner)
            parts.content, parts.calls = parsed.content, parsed.calls
        else:
            parts.content = answer
        return parts


def _named_call(function: str, answer: str, final: bool) -> tuple[str, list[ScannedCall]]:
    """The constrained output is the arguments object (trailing whitespace may still be followed by
    text); one that ends as anything else (cut off, or unconstrained) is text."""
    if not final:
        return "", [ScannedCall(name=function, arguments=answer.strip())]
    try:
        valid = isinstance(json.loads(answer), dict)
    except ValueError:
        valid = False
    if not valid:
        return answer, []
    return "", [ScannedCall(name=function, arguments=answer.strip(), end=len(answer))]


def _required_calls(answer: str, final: bool, scanner: JsonScanner) -> tuple[str, list[ScannedCall]]:
    start = skip_whitespace(answer, 0)
    if start >= len(answer):
        return (answer if final else ""), []
    try:
        calls, end = scan_call_array(answer, start, scanner)
        if final and (end is None or not calls):
            raise NotACall("cut off inside the calls")
    except NotACall:
        return answer, []  # not what the constraint asks for (cut off, or unconstrained): text
    return "", calls


def finish_reason(reason: str | None, parts: MessageParts) -> str | None:
    """OpenAI's `tool_calls` when a choice that stopped by itself called tools."""
    if reason == "stop" and any(call.done for call in parts.calls):
        return "tool_calls"
    return reason


@dataclass
class ChatMessageParts:
    """The message fields of a whole choice."""

    content: str | None
    reasoning_content: str | None
    tool_calls: list[ToolCall] | None

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's `tool_calls` when a choice that stopped by itself called tools."""
        return "tool_calls" if reason == "stop" and self.tool_calls else reason


def message(parser: ChoiceParser, text: str) -> ChatMessageParts:
    """The whole choice's message fields (content None when calls replace it, as OpenAI sends)."""
    parts = parser.parse(text, final=True)
    calls = [ToolCall(id=new_call_id(), function=FunctionCall(name=call.name or "", arguments=call.arguments))
             for call in parts.calls if call.done]
    content = parts.content if parts.content or not calls else None
    return ChatMessageParts(content=content, reasoning_content=parts.reasoning or None,
                            tool_calls=calls or None)


@dataclass
class ChoiceDelta:
    """What one step of a stream adds: text pieces (None: nothing) and tool call pieces."""

    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return self.reasoning is None and self.content is None and not self.tool_calls


class StreamedChoice:
    """The parts of one streamed choice already sent; `step` returns what is new."""

    def __init__(self, parser: ChoiceParser) -> None:
        self.parser = parser
        self.parts = MessageParts()
        self._sent_reasoning = 0
        self._sent_content = 0
        self._call_ids: list[str] = []     # per call index whose name was sent
        self._sent_arguments: list[int] = []

    def step(self, text: str, final: bool) -> ChoiceDelta:
        parts = self.parser.parse(text, final)
        self.parts = parts
        delta = ChoiceDelta()
        if len(parts.reasoning) > self._sent_reasoning:
            delta.reasoning = parts.reasoning[self._sent_reasoning:]
            self._sent_reasoning = len(parts.reasoning)
        if len(parts.content) > self._sent_content:
            delta.content = parts.content[self._sent_content:]
            self._sent_content = len(parts.content)
        for index, call in enumerate(parts.calls):
            if call.name is None or (final and not call.done):
                break  # calls are sent in order, each once its name is known
            if index == len(self._call_ids):
                self._call_ids.append(new_call_id())
                self._sent_arguments.append(0)
                opening = FunctionCallDelta(name=call.name, arguments="")
                delta.tool_calls.append(ToolCallDelta(index=index, id=self._call_ids[index], type="function",
                                                      function=opening))
            if len(call.arguments) > self._sent_arguments[index]:
                piece = call.arguments[self._sent_arguments[index]:]
                self._sent_arguments[index] = len(call.arguments)
                delta.tool_calls.append(ToolCallDelta(index=index,
                                                      function=FunctionCallDelta(arguments=piece)))
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        return finish_reason(reason, self.parts)


# -- one request's plan -------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatParsing:
    """How one chat request's output is constrained and read."""

    plan: ToolPlan
    reasoning: ReasoningSplit | None
    parse_tools: ToolCallParse | None
    kept_special_ids: tuple[int, ...] = ()  # the parsers' markers that are special tokens

    def constrain(self, params: common_pb2.SamplingParams) -> common_pb2.SamplingParams:
        """`params` with the tool schema as its structured output (400 if the body asked for
        another one too), which starts after the thinking when the request thinks, and with the
        parsers' special-token markers kept in the text."""
        params.kept_special_token_ids.extend(self.kept_special_ids)
        if self.plan.schema is not None:
            if params.HasField("structured"):
                raise bad_request(f"tool_choice {self.plan.mode!r} constrains the output to a tool call; "
                                  "it cannot be combined with response_format or structured outputs",
                                  param="tool_choice")
            params.structured.json_schema = json.dumps(self.plan.schema)
        if params.HasField("structured") and self.reasoning is not None:
            params.structured.start_after = self.reasoning.end
        return params

    def parser(self) -> ChoiceParser:
        return ChoiceParser(self.reasoning, self.plan, self.parse_tools)


def chat_parsing(plan: ToolPlan, tool_call_parser: str | None, reasoning_parser: str | None,
                 chat_template_kwargs: dict[str, Any] | None, prompt_tail: str,
                 special_tokens: Mapping[str, int] | None = None) -> ChatParsing:
    """The request's ChatParsing. `prompt_tail`: the end of the rendered prompt (a template that
    opens the thinking in the prompt starts the answer inside it). `special_tokens`: the
    tokenizer's special tokens, text -> id (services.gateway.marker_tokens)."""
    reasoning = None
    if reasoning_parser:
        enable_thinking = (chat_template_kwargs or {}).get("enable_thinking")
        reasoning = REASONING_PARSERS[reasoning_parser].for_request(enable_thinking, prompt_tail)
    parse_tools = TOOL_CALL_PARSERS[tool_call_parser] if tool_call_parser else None
    kept = kept_marker_ids(special_tokens or {}, tool_call_parser if plan.mode == "auto" else None,
                           reasoning_parser if reasoning is not None else None)
    return ChatParsing(plan, reasoning, parse_tools, kept)
