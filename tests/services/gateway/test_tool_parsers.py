"""Each --tool-call-parser format, whole and streamed: calls found with their raw arguments text,
text around them kept as content, malformed calls left as content, and a stream cut anywhere (inside
a marker, a key, an escape) assembling to the whole answer."""

from __future__ import annotations

import json

import pytest

from services.common.text_parsers import TOOL_CALL_PARSER_NAMES
from services.gateway.chat_output import ChoiceParser, StreamedChoice
from services.gateway.tool_parsers import TOOL_CALL_PARSERS
from services.gateway.tool_parsers.json_scan import JsonScanner
from tests.services.gateway.chat_streams import AUTO, check_every_split, pieces_at, stream, whole

WEATHER = '{"city": "Paris \\"FR\\"", "days": [1, 2], "unit": {"c": true}}'
TIME = '{"zone": "UTC"}'


def parser(name: str) -> ChoiceParser:
    return ChoiceParser(None, AUTO, TOOL_CALL_PARSERS[name])


def calls(answer) -> list[tuple[str, str]]:
    return [(call["name"], call["arguments"]) for call in answer.calls]


def test_every_name_the_flags_accept_has_a_parser() -> None:
    assert set(TOOL_CALL_PARSERS) == set(TOOL_CALL_PARSER_NAMES)


# text the model wrote in each format: two calls after some words
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, CALL_END = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
FORMATS = {
    "qwen25": (f'Let me look.\n<tool_call>\n{{"name": "weather", "arguments": {WEATHER}}}\n</tool_call>\n'
               f'<tool_call>\n{{"arguments": {TIME}, "name": "time"}}\n</tool_call>', "Let me look.\n\n"),
    "llama3": (f'<|python_tag|>{{"name": "weather", "parameters": {WEATHER}}}; '
               f'{{"name": "time", "parameters": {TIME}}}', ""),
    "mistral": (f'Let me look.[TOOL_CALLS] [{{"name": "weather", "arguments": {WEATHER}}}, '
                f'{{"name": "time", "arguments": {TIME}}}]', "Let me look."),
    "deepseekv3": (f"Let me look.{CALLS_BEGIN}{CALL}weather\n```json\n{WEATHER}\n```{CALL_END}\n"
                   f"{CALL}time\n```json\n{TIME}\n```{CALL_END}{CALLS_END}", "Let me look."),
}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_two_calls_whole_and_streamed_at_every_cut(name: str) -> None:
    text, content = FORMATS[name]
    answer = check_every_split(parser(name), text)
    assert calls(answer) == [("weather", WEATHER), ("time", TIME)]
    assert answer.content == content
    assert json.loads(answer.calls[0]["arguments"])["city"] == 'Paris "FR"'
    assert stream(parser(name), pieces_at(text, [5, 40])).finish_reason == "tool_calls"


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_plain_answer_is_content(name: str) -> None:
    text = "The weather in Paris is <b>fine</b> [today] {mostly}."
    answer = check_every_split(parser(name), text)
    assert (answer.content, answer.calls) == (text, [])
    assert stream(parser(name), [text]).finish_reason == "stop"


MALFORMED = {
    "qwen25": ['<tool_call>not json</tool_call> after', '<tool_call>{"name": "f", "arguments": {"a": 1}',
               '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"name": 3}</tool_call>'],
    "llama3": ['{"answer": 42}', '{"name": "f", "parameters": {"a": tru}}', '{"name": "f"} and then'],
    "mistral": ['[TOOL_CALLS] not an array', '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}',
                '[{"x": 1}]'],
    "deepseekv3": [f"{CALLS_BEGIN}nothing here", f'{CALLS_BEGIN}{CALL}f\n```json\n{{"a": 1',
                   f"{CALLS_BEGIN}{CALL}f\nno fence"],
}


@pytest.mark.parametrize(("name", "text"),
                         [(name, text) for name, texts in MALFORMED.items() for text in texts])
def test_malformed_call_is_left_as_content(name: str, text: str) -> None:
    answer = whole(parser(name), text)
    assert (answer.content, answer.calls) == (text, [])
    # a stream may have shown the start of a call before it went wrong; the text is all there
    assert stream(parser(name), list(text)).content == text
    assert stream(parser(name), [text]).finish_reason == "stop"


def test_hermes_keeps_text_between_and_after_calls() -> None:
    text = 'A<tool_call>{"name": "f", "arguments": {}}</tool_call>B<tool_call>{"name": "g"}</tool_call>C'
    answer = check_every_split(parser("qwen25"), text)
    assert answer.content == "ABC"
    assert calls(answer) == [("f", "{}"), ("g", "{}")]


def test_stringified_arguments_are_decoded() -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert calls(check_every_split(parser("qwen25"), text)) == [("f", '{"a": 1}')]


def test_arguments_stream_in_pieces_before_the_call_ends() -> None:
    text = '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'
    streamed = StreamedChoice(parser("qwen25"))
    first = streamed.step(text[:30], final=False)
    assert [(d.index, d.function.name, d.function.arguments) for d in first.tool_calls] == \
        [(0, "weather", "")]
    second = streamed.step(text[:text.index("Par") + 3], final=False)
    assert [(d.id, d.function.arguments) for d in second.tool_calls] == [(None, '{"city": "Par')]
    third = streamed.step(text, final=True)
    assert [d.function.arguments for d in third.tool_calls] == ['is"}']
    assert streamed.finish_reason("stop") == "tool_calls"


def test_llama3_without_the_python_tag_and_mistral_without_its_token() -> None:
    # the tags are special tokens that detokenization drops
    assert calls(check_every_split(parser("llama3"), f'{{"name": "time", "parameters": {TIME}}}')) == \
        [("time", TIME)]
    assert calls(check_every_split(parser("mistral"), f'[{{"name": "time", "arguments": {TIME}}}]')) == \
        [("time", TIME)]


def test_scanner_resumes_on_a_growing_text_as_a_fresh_scan_would() -> None:
    text = '{"a": [1, {"b": "x\\\\\\"}]{["}], "c": "\\u00e9"}  trailing'
    scanner = JsonScanner()
    for end in range(1, len(text) + 1):
        assert scanner.container_end(text[:end], 0) == JsonScanner().container_end(text[:end], 0), end
    # a text that does not extend the one scanned is scanned afresh
    assert scanner.container_end('{"a": 1}', 0) == 8
    assert scanner.container_end('{"a": "}"', 0) is None and scanner.container_end('{"b": 2}', 0) == 8
