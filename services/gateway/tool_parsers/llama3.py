"""Llama 3.1/3.2/3.3 JSON tool calls (SGLang's `llama3`): `<|python_tag|>` (a special token, usually
dropped by detokenization) and/or one or more `{"name": ..., "parameters": {...}}` objects separated
by `;`. An answer that does not start as a call, or turns out not to be one, is content."""

from __future__ import annotations

from services.gateway.tool_parsers.base import ParsedTools, text_until
from services.gateway.tool_parsers.json_scan import (
    JsonScanner,
    NotACall,
    ScannedCall,
    held_back,
    scan_call,
    skip_whitespace,
)

PYTHON_TAG = "<|python_tag|>"


def parse_llama3(text: str, final: bool, scanner: JsonScanner) -> ParsedTools:
    before, tag = text_until(text, PYTHON_TAG, final)
    if tag >= 0:
        content, start = before, tag + len(PYTHON_TAG)
    else:
        first = skip_whitespace(text, 0)
        if first >= len(text) or (not final and held_back(text, PYTHON_TAG) == len(text) - first):
            return ParsedTools()  # nothing yet, or the tag may be arriving
        if text[first] != "{":
            return ParsedTools(content=before)
        content, start = "", first
    try:
        return ParsedTools(content=content, calls=_calls(text, start, final, scanner))
    except NotACall:
        return ParsedTools(content=text)  # a call cannot start this way: all of it is text


def _calls(text: str, index: int, final: bool, scanner: JsonScanner) -> list[ScannedCall]:
    calls: list[ScannedCall] = []
    while True:
        index = skip_whitespace(text, index)
        if index >= len(text):
            if final and not calls:
                raise NotACall("no call after the python tag")
            return calls
        call = scan_call(text, index, scanner)
        if call.end is None and final:
            raise NotACall("cut off inside a call")
        calls.append(call)
        if call.end is None:
            return calls
        index = skip_whitespace(text, call.end)
        if index >= len(text):
            return calls
        if text[index] != ";":
            raise NotACall("calls are separated by ';'")
        index += 1
