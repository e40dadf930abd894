"""DeepSeek-V3 tool calls (SGLang's `deepseekv3`):
`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{ARGS}\\n```<｜tool▁call▁end｜>`
repeated, then `<｜tool▁calls▁end｜>`; text before the first is content."""

from __future__ import annotations

import json

from services.gateway.tool_parsers.base import ParsedTools, text_until
from services.gateway.tool_parsers.json_scan import (
    JsonScanner,
    NotACall,
    ScannedCall,
    skip_whitespace,
    value_end,
)

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE_OPEN = "```json"
FENCE_CLOSE = "```"


def parse_deepseekv3(text: str, final: bool, scanner: JsonScanner) -> ParsedTools:
    content, begin = text_until(text, CALLS_BEGIN, final)
    if begin < 0:
        return ParsedTools(content=content)
    calls: list[ScannedCall] = []
    index = begin + len(CALLS_BEGIN)
    try:
        while True:
            index = skip_whitespace(text, index)
            if _pending(text, index, CALLS_END) or text.startswith(CALLS_END, index):
                break
            if _pending(text, index, CALL_BEGIN):
                break
            if not text.startswith(CALL_BEGIN, index):
                raise NotACall("expected a tool call")
            call, index = _call(text, index + len(CALL_BEGIN), scanner)
            calls.append(call)
            if call.end is None:
                break
        if final and (not calls or not calls[-1].done):
            raise NotACall("no complete call")
    except NotACall:
        return ParsedTools(content=text)  # not in the format: all of it is text
    return ParsedTools(content=content, calls=calls)


def _pending(text: str, index: int, marker: str) -> bool:
    """The text ends inside `marker` (or right before it)."""
    rest = text[index:]
    return len(rest) < len(marker) and marker.startswith(rest)


def _call(text: str, index: int, scanner: JsonScanner) -> tuple[ScannedCall, int]:
    """One call from after its begin marker: the call so far and the index after it."""
    call = ScannedCall()
    sep = text.find(SEP, index)
    if sep < 0:
        if SEP[0] in text[index:] and not _pending(text, text.index(SEP[0], index), SEP):
            raise NotACall("expected the tool separator")
        return call, len(text)
    newline = text.find("\n", sep + len(SEP))
    if newline < 0:
        return call, len(text)
    call.name = text[sep + len(SEP):newline].strip()
    if not call.name:
        raise NotACall("a tool call names its function")
    fence = skip_whitespace(text, newline)
    rest = text[fence:]
    if len(rest) < len(FENCE_OPEN):
        if not FENCE_OPEN.startswith(rest):
            raise NotACall("expected ```json")
        return call, len(text)
    if not rest.startswith(FENCE_OPEN):
        raise NotACall("expected ```json")
    start = skip_whitespace(text, fence + len(FENCE_OPEN))
    if start >= len(text):
        return call, len(text)
    if text[start] != "{":
        raise NotACall("a tool call's arguments are an object")
    end = value_end(text, start, scanner)
    call.arguments = text[start:end] if end is not None else text[start:]
    if end is None:
        return call, len(text)
    closing = skip_whitespace(text, end)
    for marker in (FENCE_CLOSE, CALL_END):
        if _pending(text, closing, marker):
            return call, len(text)
        if not text.startswith(marker, closing):
            raise NotACall(f"expected {marker}")
        closing = skip_whitespace(text, closing + len(marker))
    try:
        if not isinstance(json.loads(call.arguments), dict):
            raise NotACall("a tool call's arguments are an object")
    except ValueError:
        raise NotACall("a tool call's arguments are not valid JSON") from None
    call.end = closing
    return call, closing
