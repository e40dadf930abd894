"""A tolerant scanner over JSON text that may still be growing: where a value ends (or that it has
not ended yet), and the tool call objects `{"name": ..., "arguments": {...}}` in it.

Tool call parsers run over a choice's whole text after every chunk (services/gateway/chat_output.py),
so a call's arguments are shown as the raw JSON text the model wrote: the text of an unfinished
arguments object is a prefix of its final text, which makes streamed argument pieces assemble to the
non-streamed answer exactly.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

WHITESPACE = " \t\r\n"
NAME_KEYS = ("name",)
ARGUMENT_KEYS = ("arguments", "parameters")


class NotACall(ValueError):
    """The text is not (the start of) a tool call in the expected shape."""


@dataclass
class ScannedCall:
    """One tool call as far as the text goes. `name`: set once its string is complete.
    `arguments`: the raw JSON text of the arguments object so far (a prefix of its final text; a
    stringified-JSON value is shown only when complete, decoded). `end`: the index just past the
    call in the text, None while it is unfinished."""

    name: str | None = None
    arguments: str = ""
    end: int | None = None

    @property
    def done(self) -> bool:
        return self.end is not None


def skip_whitespace(text: str, index: int) -> int:
    while index < len(text) and text[index] in WHITESPACE:
        index += 1
    return index


def string_end(text: str, index: int) -> int | None:
    """Index past the JSON string starting at `index` (a '"'); None if it is not closed yet."""
    index += 1
    while True:
        stop = _STRING_STOP.search(text, index)
        if stop is None:
            return None
        if text[stop.start()] == '"':
            return stop.start() + 1
        index = stop.start() + 2  # past the escaped character


def value_end(text: str, index: int, scanner: JsonScanner | None = None) -> int | None:
    """Index past the JSON value starting at `index`; None if the text ends inside it (a number or a
    literal at the very end may go on). Raises NotACall on a character no value starts with; the
    value's inner syntax is checked by json.loads once it is complete. Objects and arrays are scanned
    by `scanner` when given (resuming where it stopped on a shorter text)."""
    if index >= len(text):
        return None
    first = text[index]
    if first == '"':
        return string_end(text, index)
    if first in "{[":
        return (scanner or JsonScanner()).container_end(text, index)
    if first in "-0123456789tfn":
        while index < len(text) and text[index] not in ",}] \t\r\n":
            index += 1
        return index if index < len(text) else None
    raise NotACall(f"no JSON value starts with {first!r}")


_STRUCTURE = re.compile(r'[{}\[\]"]')
_STRING_STOP = re.compile(r'["\\]')


class JsonScanner:
    """Finds where JSON objects and arrays end, remembering how far it got in each unfinished one.

    Parsers run over a choice's whole text after every chunk; a stream's text only grows, so an
    arguments object thousands of characters long would otherwise be rescanned from its start at
    every token (seconds of the gateway's event loop for one long call). Each unfinished value
    keeps the text it scanned, its nesting depth and whether it stopped inside a string; a longer
    text that starts with that text resumes there. One scanner per choice."""

    def __init__(self) -> None:
        self._unfinished: dict[int, tuple[str, int, bool]] = {}  # start -> (text scanned, depth, in a string)

    def container_end(self, text: str, start: int) -> int | None:
        position, depth, in_string = start, 0, False
        saved = self._unfinished.get(start)
        if saved is not None and text.startswith(saved[0]):
            position, depth, in_string = len(saved[0]), saved[1], saved[2]
        while position < len(text):
            if in_string:
                stop = _STRING_STOP.search(text, position)
                if stop is None:
                    position = len(text)
                    break
                position = stop.start()
                if text[position] == "\\":
                    if position + 1 >= len(text):
                        break  # the escaped character is still to come: resume at the backslash
                    position += 2
                    continue
                in_string = False
                position += 1
                continue
            found = _STRUCTURE.search(text, position)
            if found is None:
                position = len(text)
                break
            position = found.start()
            char = text[position]
            position += 1
            if char == '"':
                in_string = True
            elif char in "{[":
                depth += 1
            else:
                depth -= 1
                if depth == 0:
                    self._unfinished.pop(start, None)
                    return position
        self._unfinished[start] = (text[:position], depth, in_string)
        return None


def _loads(raw: str) -> object:
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise NotACall(f"not valid JSON: {exc}") from None


def scan_call(text: str, start: int, scanner: JsonScanner | None = None) -> ScannedCall:
    """The tool call object starting at text[start] ('{'): keys `name` and `arguments` (or
    `parameters`) in either order. Raises NotACall when the text cannot be one: not an object, a
    name that is not a string, arguments that are not an object (or a string holding one), or, once
    complete, no name or invalid JSON."""
    if text[start:start + 1] != "{":
        raise NotACall("a tool call is a JSON object")
    call = ScannedCall()
    index = start + 1
    has_arguments = False
    while True:
        index = skip_whitespace(text, index)
        if index >= len(text):
            return call
        if text[index] == "}":
            break
        if text[index] != '"':
            raise NotACall("expected a key")
        key_end = string_end(text, index)
        if key_end is None:
            return call
        key = _loads(text[index:key_end])
        index = skip_whitespace(text, key_end)
        if index >= len(text):
            return call
        if text[index] != ":":
            raise NotACall("expected ':' after a key")
        value_start = skip_whitespace(text, index + 1)
        end = value_end(text, value_start, scanner)
        if key in NAME_KEYS:
            if value_start < len(text) and text[value_start] != '"':
                raise NotACall("a tool call's name is a string")
            if end is not None:
                call.name = str(_loads(text[value_start:end]))
        elif key in ARGUMENT_KEYS:
            has_arguments = True
            call.arguments = _arguments(text, value_start, end)
        if end is None:
            return call
        index = skip_whitespace(text, end)
        if index >= len(text):
            return call
        if text[index] == ",":
            index += 1
        elif text[index] != "}":
            raise NotACall("expected ',' or '}' in a tool call")
    call.end = index + 1
    if call.name is None:
        raise NotACall("a tool call names its function")
    _loads(text[start:call.end])  # numbers and literals are checked here, once
    if not has_arguments:
        call.arguments = "{}"
    return call


def _arguments(text: str, start: int, end: int | None) -> str:
    """The arguments value as tool_calls[].function.arguments shows it (see ScannedCall)."""
    if start >= len(text):
        return ""
    first = text[start]
    if first == "{":
        raw = text[start:end] if end is not None else text[start:]
        if end is not None and not isinstance(_loads(raw), dict):
            raise NotACall("a tool call's arguments are an object")
        return raw
    if first == '"':
        if end is None:
            return ""
        decoded = _loads(text[start:end])
        if not isinstance(decoded, str) or not isinstance(_loads(decoded), dict):
            raise NotACall("a tool call's string arguments hold a JSON object")
        return decoded
    if text.startswith("null", start) or (end is None and "null".startswith(text[start:])):
        return "{}" if end is not None else ""
    raise NotACall("a tool call's arguments are an object")


def scan_call_array(text: str, start: int,
                    scanner: JsonScanner | None = None) -> tuple[list[ScannedCall], int | None]:
    """The calls of a JSON array of call objects starting at text[start] ('['), and the index past
    the array (None while unfinished). Raises NotACall as scan_call does, or for other items."""
    if text[start:start + 1] != "[":
        raise NotACall("expected a JSON array of tool calls")
    calls: list[ScannedCall] = []
    index = skip_whitespace(text, start + 1)
    if text[index:index + 1] == "]":
        return calls, index + 1
    while True:
        index = skip_whitespace(text, index)
        if index >= len(text):
            return calls, None
        call = scan_call(text, index, scanner)
        calls.append(call)
        if call.end is None:
            return calls, None
        index = skip_whitespace(text, call.end)
        if index >= len(text):
            return calls, None
        if text[index] == "]":
            return calls, index + 1
        if text[index] != ",":
            raise NotACall("expected ',' or ']' between tool calls")
        index += 1


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (to hold back from
    the content until the next chunk says whether they are)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
