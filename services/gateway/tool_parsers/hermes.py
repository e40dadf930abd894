"""Hermes-style tool calls (SGLang's `qwen25` and `qwen`; Qwen2.5, Qwen3, Hermes models): each call
is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, with text around them as content."""

from __future__ import annotations

from services.gateway.tool_parsers.base import ParsedTools, text_until
from services.gateway.tool_parsers.json_scan import JsonScanner, NotACall, scan_call, skip_whitespace

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


def parse_hermes(text: str, final: bool, scanner: JsonScanner) -> ParsedTools:
    parsed = ParsedTools()
    position = 0
    while True:
        before, start = text_until(text[position:], OPEN, final)
        parsed.content += before
        if start < 0:
            return parsed
        block = position + start
        body = skip_whitespace(text, block + len(OPEN))
        try:
            if body >= len(text):
                raise NotACall("empty tool call")
            call = scan_call(text, body, scanner)
        except NotACall:
            # not a call: the block's text is content once its end shows (all of it at the end)
            close = text.find(CLOSE, block)
            if close < 0:
                if final:
                    parsed.content += text[block:]
                return parsed
            parsed.content += text[block:close + len(CLOSE)]
            position = close + len(CLOSE)
            continue
        if call.end is None:
            if final:  # cut off inside the call: what it wrote stays text
                parsed.content += text[block:]
            else:
                parsed.calls.append(call)
            return parsed
        parsed.calls.append(call)
        after = skip_whitespace(text, call.end)
        # a missing close tag is forgiven: the call itself is complete
        position = after + len(CLOSE) if text.startswith(CLOSE, after) else call.end
        if not final and after >= len(text) - len(CLOSE) and CLOSE.startswith(text[after:]):
            return parsed  # the close tag may still be arriving: say nothing of what follows
