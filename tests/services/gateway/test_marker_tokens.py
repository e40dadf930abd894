"""Tool call markers that the tokenizer makes special tokens reach the parser: the gateway asks the
worker to keep exactly those tokens when a parser reads the output, the text keeps them (and still
skips every other special token), and a request without a parser asks for nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer

from pdserve.text import TextStream
from protos.v1 import common_pb2
from services.gateway.chat_output import chat_parsing, message
from services.gateway.marker_tokens import kept_marker_ids, special_token_ids
from services.gateway.tool_choice import ToolPlan
from services.worker.wire import sampling_from_proto, sampling_to_proto

CALL = '{"name": "time", "arguments": {"zone": "UTC"}}'


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Tokenizer:
    """The test checkpoint's tokenizer with Qwen's tool call tags as special tokens."""
    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(tag, special=True, normalized=False)
                                  for tag in ("<tool_call>", "</tool_call>")])
    return tokenizer


def output_text(tokenizer: Tokenizer, ids: list[int], kept: tuple[int, ...]) -> str:
    """The text a worker makes of `ids`, token by token."""
    stream = TextStream(tokenizer, kept_special_ids=kept)
    return "".join(stream.push(token_id)[0] for token_id in ids) + stream.flush()


def test_a_tool_call_in_special_tokens_reaches_the_parser(tokenizer: Tokenizer) -> None:
    specials = special_token_ids(tokenizer)
    tags = (specials["<tool_call>"], specials["</tool_call>"])
    plan = ToolPlan("auto", template_tools=[])
    parsing = chat_parsing(plan, "qwen25", None, None, "", specials)
    params = parsing.constrain(common_pb2.SamplingParams())
    assert tuple(params.kept_special_token_ids) == tags
    # the worker's side of the wire carries the list
    assert sampling_from_proto(params).kept_special_token_ids == tags
    assert sampling_to_proto(sampling_from_proto(params)).kept_special_token_ids == list(tags)

    ids = tokenizer.encode(f"Sure.<tool_call>{CALL}</tool_call><|im_start|>", add_special_tokens=False).ids
    assert tags[0] in ids and specials["<|im_start|>"] in ids
    assert output_text(tokenizer, ids, ()) == f"Sure.{CALL}"  # what a worker sent before: no call
    text = output_text(tokenizer, ids, tuple(params.kept_special_token_ids))
    assert text == f"Sure.<tool_call>{CALL}</tool_call>"  # other special tokens still skipped
    answer = message(parsing.parser(), text)
    assert answer.content == "Sure." and answer.tool_calls is not None
    assert [(call.function.name, call.function.arguments) for call in answer.tool_calls] == \
        [("time", '{"zone": "UTC"}')]


def test_plain_requests_keep_nothing(tokenizer: Tokenizer) -> None:
    specials = special_token_ids(tokenizer)
    for plan, parser in ((ToolPlan("none"), "qwen25"), (ToolPlan("auto", template_tools=[]), None),
                         (ToolPlan("required", schema={"type": "array"}), "qwen25")):
        parsing = chat_parsing(plan, parser, None, None, "", specials)
        assert list(parsing.constrain(common_pb2.SamplingParams()).kept_special_token_ids) == []
    # markers the tokenizer keeps as plain text need nothing either
    assert kept_marker_ids(specials, "mistral", None) == ()
    assert kept_marker_ids(special_token_ids(tokenizer) | {"[ARGS]": 7}, "mistral", None) == (7,)
