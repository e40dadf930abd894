"""--reasoning-parser splits (whole and streamed, cut anywhere), the schemas `required` and named
tool choices constrain the output with, the 400s for a tool_choice the tools do not allow, and the
structured output a request sends (after the thinking when it thinks)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from protos.v1 import common_pb2
from services.common.text_parsers import REASONING_PARSER_NAMES
from services.gateway.chat_output import ChoiceParser, chat_parsing
from services.gateway.errors import GatewayError
from services.gateway.reasoning_parsers import REASONING_PARSERS
from services.gateway.tool_choice import NamedToolChoice, ToolPlan, plan_tools
from services.gateway.tool_parsers import TOOL_CALL_PARSERS
from tests.services.gateway.chat_streams import AUTO, check_every_split, stream

THINK = "<think>\nThe user wants weather.\n</think>\n\nIt is sunny."
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "time"}}]


def reasoning(name: str, enable_thinking: object = None, prompt_tail: str = "") -> ChoiceParser:
    split = REASONING_PARSERS[name].for_request(enable_thinking, prompt_tail)
    return ChoiceParser(split, ToolPlan("none"), None)


def test_every_name_the_flags_accept_has_a_parser() -> None:
    assert set(REASONING_PARSERS) == set(REASONING_PARSER_NAMES)


@pytest.mark.parametrize("name", ["qwen3", "deepseek-r1"])
def test_thinking_goes_to_reasoning_content(name: str) -> None:
    answer = check_every_split(reasoning(name), THINK)
    assert (answer.reasoning, answer.content) == ("The user wants weather.\n", "It is sunny.")


def test_thinking_opened_by_the_prompt() -> None:
    # DeepSeek-R1's template (and Qwen3 thinking ones) end the prompt with <think>
    text = "The user wants weather.</think>It is sunny."
    opened_by_prompt = reasoning("qwen3", prompt_tail="<|im_start|>assistant\n<think>\n")
    for parser in (reasoning("deepseek-r1"), opened_by_prompt):
        answer = check_every_split(parser, text)
        assert (answer.reasoning, answer.content) == ("The user wants weather.", "It is sunny.")


def test_qwen3_without_thinking() -> None:
    assert check_every_split(reasoning("qwen3"), "It is sunny.").content == "It is sunny."
    assert reasoning("qwen3", enable_thinking=False).reasoning is None
    assert reasoning("deepseek-r1", enable_thinking=False).reasoning is not None  # R1 always thinks


def test_unfinished_thinking_is_all_reasoning() -> None:
    answer = stream(reasoning("qwen3"), list("<think>still going </thi"), reason="length")
    assert (answer.reasoning, answer.content, answer.finish_reason) == ("still going </thi", "", "length")


def test_thinking_then_a_tool_call() -> None:
    call = '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    text = THINK.replace("It is sunny.", call)
    parser = ChoiceParser(REASONING_PARSERS["qwen3"].for_request(None, ""), AUTO, TOOL_CALL_PARSERS["qwen25"])
    answer = check_every_split(parser, text)
    assert answer.reasoning == "The user wants weather.\n"
    assert [(c["name"], c["arguments"]) for c in answer.calls] == [("weather", '{"city": "Oslo"}')]


# -- tool_choice ------------------------------------------------------------------------------

def named(name: str) -> NamedToolChoice:
    return NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


def test_named_choice_is_constrained_to_its_parameters() -> None:
    plan = plan_tools(TOOLS, named("weather"), True)
    assert (plan.mode, plan.function, plan.schema) == ("named", "weather", TOOLS[0]["function"]["parameters"])
    answer = check_every_split(ChoiceParser(None, plan, None), ' {"city": "Oslo"} ')
    assert [(c["name"], c["arguments"]) for c in answer.calls] == [("weather", '{"city": "Oslo"}')]
    assert stream(ChoiceParser(None, plan, None), ['{"city": "Oslo"}']).finish_reason == "tool_calls"


def test_required_schema_accepts_calls_of_each_tool_and_only_them() -> None:
    plan = plan_tools(TOOLS, "required", parallel_tool_calls=False)
    assert plan.schema is not None
    jsonschema.validate([{"name": "weather", "parameters": {"city": "Oslo"}}], plan.schema)
    jsonschema.validate([{"name": "time", "parameters": {}}], plan.schema)
    for wrong in ([], [{"name": "weather", "parameters": {}}], [{"name": "other", "parameters": {}}],
                  [{"name": "time", "parameters": {}, "note": "extra"}],
                  [{"name": "time", "parameters": {}}, {"name": "time", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, plan.schema)
    parallel = plan_tools(TOOLS, "required", parallel_tool_calls=True).schema
    jsonschema.validate([{"name": "time", "parameters": {}}, {"name": "time", "parameters": {}}], parallel)
    text = '[{"name": "weather", "parameters": {"city": "Oslo"}}, {"name": "time", "parameters": {}}]'
    answer = check_every_split(ChoiceParser(None, plan, None), text)
    assert [(c["name"], c["arguments"]) for c in answer.calls] == \
        [("weather", '{"city": "Oslo"}'), ("time", "{}")]


@pytest.mark.parametrize(("tools", "choice", "says"), [
    (TOOLS, "nope", "tool_choice names function 'nope', which is not among the tools ('weather', 'time')"),
    (None, "required", "tool_choice 'required' needs tools"),
    ([{"type": "retrieval"}], "auto", "tools[0] is not"),
    ([{"type": "function", "function": {"name": ""}}], "auto", "tools[0].function.name must be"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "auto",
     "tools[0].function.parameters"),
])
def test_bad_tool_choice_is_a_400_naming_it(tools, choice, says: str) -> None:
    with pytest.raises(GatewayError) as raised:
        plan_tools(tools, named(choice) if choice == "nope" else choice, True)
    assert raised.value.status == 400 and says in raised.value.message


def test_none_hides_the_tools_and_auto_shows_them() -> None:
    assert plan_tools(TOOLS, "none", True).template_tools is None
    assert plan_tools(TOOLS, None, True).template_tools == TOOLS
    assert plan_tools(None, None, True).mode == "none"


def test_structured_output_starts_after_the_thinking() -> None:
    plan = plan_tools(TOOLS, named("weather"), True)
    thinking = chat_parsing(plan, "qwen25", "qwen3", None, "")
    params = thinking.constrain(common_pb2.SamplingParams())
    assert json.loads(params.structured.json_schema) == TOOLS[0]["function"]["parameters"]
    assert params.structured.start_after == "</think>"
    not_thinking = chat_parsing(plan, "qwen25", "qwen3", {"enable_thinking": False}, "")
    assert not_thinking.constrain(common_pb2.SamplingParams()).structured.start_after == ""
    other = common_pb2.SamplingParams()
    other.structured.json_object = True
    r1 = chat_parsing(ToolPlan("none"), None, "deepseek-r1", None, "")
    assert r1.constrain(other).structured.start_after == "</think>"
    with pytest.raises(GatewayError, match="cannot be combined"):
        thinking.constrain(other)
