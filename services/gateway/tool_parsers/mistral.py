"""Mistral tool calls (SGLang's `mistral`), in both forms Mistral's templates use:

- older: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}`;
- newer (tokenizer v11 on): each call is `[TOOL_CALLS]NAME[ARGS]{...}`, optionally
  `[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}`, one after another.

`[TOOL_CALLS]` is a special token that detokenization may drop, so an answer that starts with `[{`
is read as the array too (the newer form cannot be read without its markers, which the gateway asks
the worker to keep when they are special tokens)."""

from __future__ import annotations

import json
import re

from services.gateway.tool_parsers.base import ParsedTools, text_until
from services.gateway.tool_parsers.json_scan import (
    JsonScanner,
    NotACall,
    ScannedCall,
    held_back,
    scan_call_array,
    skip_whitespace,
    value_end,
)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
MARKERS = (TOOL_CALLS, ARGS, CALL_ID)
# what a function name (and a call id) may hold; anything else before [ARGS] is not a call
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")


def parse_mistral(text: str, final: bool, scanner: JsonScanner) -> ParsedTools:
    before, tag = text_until(text, TOOL_CALLS, final)
    if tag >= 0:
        content, start = before, skip_whitespace(text, tag + len(TOOL_CALLS))
        if start < len(text) and text[start] != "[":
            return _named_calls(text, content, tag, final, scanner)
    else:
        first = skip_whitespace(text, 0)
        if first >= len(text):
            return ParsedTools(content=text if final else "")  # a call array may follow
        if text[first] != "[":
            return ParsedTools(content=before)
        second = skip_whitespace(text, first + 1)
        if second >= len(text) and not final:
            return ParsedTools()  # "[": the array or the tag may be starting
        if text[second:second + 1] != "{":
            return ParsedTools(content=before)
        content, start = "", first
    if start >= len(text):
        return ParsedTools(content=text if final else content)
    try:
        calls, end = scan_call_array(text, start, scanner)
        if final and (end is None or not calls):
            raise NotACall("cut off inside the calls")
    except NotACall:
        return ParsedTools(content=text)  # what the model wrote is not a call array: all of it is text
    return ParsedTools(content=content, calls=calls)


def _named_calls(text: str, content: str, position: int, final: bool, scanner: JsonScanner) -> ParsedTools:
    """The `[TOOL_CALLS]NAME[ARGS]{...}` calls from the marker at `position` on. Text between and
    after complete calls (other than whitespace) is content, as the model wrote it; a first call that
    is not well formed makes all of the text content, a later one the text from its marker on."""
    parsed = ParsedTools(content=content)
    while True:
        try:
            call = _named_call(text, position + len(TOOL_CALLS), final, scanner)
        except NotACall:
            if not parsed.calls:
                return ParsedTools(content=text)
            parsed.content += text[position:]
            return parsed
        parsed.calls.append(call)
        if call.end is None:
            return parsed
        between, found = text_until(text[call.end:], TOOL_CALLS, final)
        if between.strip():
            parsed.content += between
        if found < 0:
            return parsed
        position = call.end + found


def _named_call(text: str, index: int, final: bool, scanner: JsonScanner) -> ScannedCall:
    """One call from after its `[TOOL_CALLS]`: its name once `[ARGS]` shows, its arguments so far
    and `end` once they are complete. Raises NotACall when the text cannot be one (or, when final,
    is not a whole one)."""
    args = text.find(ARGS, index)
    if args < 0:
        head = text[index:]
        pending = head[:len(head) - max(held_back(head, ARGS), held_back(head, CALL_ID))]
        name, _, call_id = pending.partition(CALL_ID)
        if final or not _NAME.fullmatch(name.strip()) or not _NAME.fullmatch(call_id):
            raise NotACall("expected NAME[ARGS]")
        return ScannedCall()
    name, _, call_id = text[index:args].partition(CALL_ID)
    name = name.strip()
    if not name or not _NAME.fullmatch(name) or not _NAME.fullmatch(call_id.strip()):
        raise NotACall("a tool call's name is a function name")
    call = ScannedCall(name=name)
    start = skip_whitespace(text, args + len(ARGS))
    if start >= len(text):
        if final:
            raise NotACall("no arguments after [ARGS]")
        return call
    if text[start] != "{":
        raise NotACall("a tool call's arguments are an object")
    end = value_end(text, start, scanner)
    call.arguments = text[start:end] if end is not None else text[start:]
    if end is None:
        if final:
            raise NotACall("cut off inside the arguments")
        return call
    try:
        if not isinstance(json.loads(call.arguments), dict):
            raise NotACall("a tool call's arguments are an object")
    except ValueError:
        raise NotACall("a tool call's arguments are not valid JSON") from None
    call.end = end
    return call
