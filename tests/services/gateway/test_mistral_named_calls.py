"""Mistral's newer tool call form, `[TOOL_CALLS]NAME[ARGS]{...}` per call (optionally with
`[CALL_ID]ID` before `[ARGS]`), beside the JSON-array form: whole, and streamed cut at every position."""

from __future__ import annotations

import pytest

from services.gateway.chat_output import ChoiceParser
from services.gateway.tool_parsers import TOOL_CALL_PARSERS
from tests.services.gateway.chat_streams import AUTO, check_every_split, stream, whole

WEATHER = '{"city": "Paris \\"FR\\"", "days": [1, 2], "unit": {"c": true}}'
TIME = '{"zone": "UTC"}'


def parser() -> ChoiceParser:
    return ChoiceParser(None, AUTO, TOOL_CALL_PARSERS["mistral"])


def calls(answer) -> list[tuple[str, str]]:
    return [(call["name"], call["arguments"]) for call in answer.calls]


@pytest.mark.parametrize(("text", "content"), [
    (f"Let me look.[TOOL_CALLS]weather[ARGS]{WEATHER}[TOOL_CALLS]time[ARGS]{TIME}", "Let me look."),
    (f"[TOOL_CALLS]weather[CALL_ID]a1B2c3D4e[ARGS]{WEATHER}\n[TOOL_CALLS]time[CALL_ID]x9[ARGS] {TIME}", ""),
])
def test_named_calls_whole_and_streamed_at_every_cut(text: str, content: str) -> None:
    answer = check_every_split(parser(), text)
    assert calls(answer) == [("weather", WEATHER), ("time", TIME)]
    assert answer.content == content
    assert stream(parser(), [text]).finish_reason == "tool_calls"


def test_text_after_a_call_is_content() -> None:
    answer = check_every_split(parser(), f"[TOOL_CALLS]time[ARGS]{TIME} done.")
    assert calls(answer) == [("time", TIME)] and answer.content == " done."


def test_the_json_array_form_still_reads() -> None:
    text = f'Hi.[TOOL_CALLS] [{{"name": "time", "arguments": {TIME}}}]'
    answer = check_every_split(parser(), text)
    assert calls(answer) == [("time", TIME)] and answer.content == "Hi."


@pytest.mark.parametrize("text", [
    "[TOOL_CALLS]get weather[ARGS]{}",           # not a function name
    "[TOOL_CALLS]time",                          # no arguments marker
    "[TOOL_CALLS]time[ARGS]",                    # no arguments
    '[TOOL_CALLS]time[ARGS]{"zone": "UTC"',      # cut off inside them
    "[TOOL_CALLS]time[ARGS][1, 2]",              # not an object
    '[TOOL_CALLS]time[ARGS]{"zone": UTC}',       # not JSON
])
def test_a_malformed_first_call_is_all_content(text: str) -> None:
    answer = whole(parser(), text)
    assert (answer.content, answer.calls) == (text, [])
    assert stream(parser(), list(text)).content == text
    assert stream(parser(), [text]).finish_reason == "stop"


def test_a_malformed_later_call_leaves_the_first_and_the_rest_as_text() -> None:
    text = f"[TOOL_CALLS]time[ARGS]{TIME}[TOOL_CALLS]oops"
    answer = whole(parser(), text)
    assert calls(answer) == [("time", TIME)] and answer.content == "[TOOL_CALLS]oops"
