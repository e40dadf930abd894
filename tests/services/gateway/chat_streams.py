"""Helpers for the chat output parser tests: a choice's text streamed in pieces, assembled as an
OpenAI client assembles the deltas."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from services.gateway.chat_output import ChoiceParser, StreamedChoice, message
from services.gateway.tool_choice import ToolPlan


@dataclass
class Assembled:
    reasoning: str = ""
    content: str = ""
    calls: list[dict] = field(default_factory=list)  # {"id", "name", "arguments"}
    finish_reason: str | None = None


def pieces_at(text: str, cuts: Sequence[int]) -> list[str]:
    bounds = [0, *sorted(set(cut for cut in cuts if 0 < cut < len(text))), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def stream(parser: ChoiceParser, pieces: Sequence[str], reason: str = "stop") -> Assembled:
    """Feed `pieces` one by one (the last one final) and assemble the deltas; checks the OpenAI
    shape: a call's id, type and name come once, in its first piece, and calls come in order."""
    streamed = StreamedChoice(parser)
    out = Assembled()
    text = ""
    for position, piece in enumerate(pieces):
        text += piece
        final = position == len(pieces) - 1
        delta = streamed.step(text, final)
        out.reasoning += delta.reasoning or ""
        out.content += delta.content or ""
        for call in delta.tool_calls:
            if call.id is not None:
                assert call.index == len(out.calls) and call.type == "function" and call.function.name
                out.calls.append({"id": call.id, "name": call.function.name, "arguments": ""})
            else:
                assert call.function.name is None and call.index == len(out.calls) - 1
            out.calls[call.index]["arguments"] += call.function.arguments or ""
    out.finish_reason = streamed.finish_reason(reason)
    return out


def whole(parser: ChoiceParser, text: str) -> Assembled:
    parts = message(parser, text)
    calls = [{"id": call.id, "name": call.function.name, "arguments": call.function.arguments}
             for call in parts.tool_calls or []]
    return Assembled(parts.reasoning_content or "", parts.content or "", calls)


def without_ids(assembled: Assembled) -> tuple:
    return (assembled.reasoning, assembled.content,
            [(call["name"], call["arguments"]) for call in assembled.calls])


def check_every_split(parser: ChoiceParser, text: str) -> Assembled:
    """The whole answer; the stream equals it wherever the text is cut in two, and cut into single
    characters."""
    expected = whole(parser, text)
    for cut in range(1, len(text)):
        assert without_ids(stream(parser, pieces_at(text, [cut]))) == without_ids(expected), cut
    assert without_ids(stream(parser, list(text))) == without_ids(expected)
    return expected


AUTO = ToolPlan("auto", template_tools=[])
