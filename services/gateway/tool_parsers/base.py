"""What every tool call format's parser returns, and the helpers they share.

A format's parser is a function `parse(text, final, scanner) -> ParsedTools` over a choice's whole
text so far (the text after any reasoning; `scanner` is the choice's JsonScanner). It must be
monotone: for a longer text its `content` extends the previous `content` and each call's
`arguments` extends the previous ones, so streaming can send the differences
(services/gateway/chat_output.py). With `final=False` it holds back what may still turn into a call
(a partial start marker); with `final=True` a call that is not well formed is given back as
content, as the model wrote it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from services.gateway.tool_parsers.json_scan import JsonScanner, ScannedCall, held_back


@dataclass
class ParsedTools:
    """The content (text outside tool calls) and the calls found so far."""

    content: str = ""
    calls: list[ScannedCall] = field(default_factory=list)


# parse(text, final, scanner): `scanner` is the choice's own (it remembers unfinished JSON values)
ToolCallParse = Callable[[str, bool, JsonScanner], ParsedTools]


def text_until(text: str, marker: str, final: bool) -> tuple[str, int]:
    """The content before `marker` and the marker's index (-1 if absent). Without the marker and
    with more text to come, a suffix that may be the marker's start is held back."""
    index = text.find(marker)
    if index >= 0:
        return text[:index], index
    if final:
        return text, -1
    return text[:len(text) - held_back(text, marker)], -1
