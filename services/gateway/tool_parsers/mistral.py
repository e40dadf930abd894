"""Mistral tool calls (SGLang's `mistral`): `[TOOL_CALLS]` then a JSON array of
`{"name": ..., "arguments": {...}}`. `[TOOL_CALLS]` is a special token that detokenization may drop,
so an answer that starts with `[{` is read as the array too."""

from __future__ import annotations

from services.gateway.tool_parsers.base import ParsedTools, text_until
from services.gateway.tool_parsers.json_scan import JsonScanner, NotACall, scan_call_array, skip_whitespace

TOOL_CALLS = "[TOOL_CALLS]"


def parse_mistral(text: str, final: bool, scanner: JsonScanner) -> ParsedTools:
    before, tag = text_until(text, TOOL_CALLS, final)
    if tag >= 0:
        content, start = before, skip_whitespace(text, tag + len(TOOL_CALLS))
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
