"""Tool calls and reasoning through the official openai client, against a colocated worker on the
tiny preset with a chat template that renders tools, assistant tool calls, tool results and
Qwen3's enable_thinking switch.

The worker is started with --tool-call-parser qwen25 --reasoning-parser qwen3 and the first gateway
learns them from it (no --model-path); the others are launch-routers given another
--tool-call-parser, which wins. The tiny model is random: `auto` parsing is shown on text forced
with a structured output (one allowed string: the call in the parser's format), and `required` and
named choices on the model's own answers under the tools' schemas, which must validate, streamed
and not (the deltas assembling to the non-streamed answer). Those need the worker's grammar
engine; without it they skip.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import openai
import pytest

from services.gateway.prompts import ModelFiles
from tests.e2e.cluster import Cluster, Proc
from tests.e2e.test_gateway import worker_args

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                         "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
        "required": ["hour"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"terms": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                               "maximum": 9},
                                                   "minItems": 1, "maxItems": 3}},
        "required": ["terms"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "minLength": 2, "maxLength": 10},
                                         "limit": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 5},
                                                             {"type": "null"}]}},
        "required": ["query", "limit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "set_alarm", "parameters": {
        "type": "object", "properties": {"time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                                         "repeat": {"type": "boolean"},
                                         "label": {"type": "object", "properties": {
                                             "text": {"type": "string", "maxLength": 6}},
                                             "required": ["text"], "additionalProperties": False}},
        "required": ["time", "repeat", "label"], "additionalProperties": False}}},
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
CALL_ARGS = '{"city": "Oslo", "unit": "c"}'
# a call in each parser's format, as forced text
FORCED = {
    "qwen25": f'<tool_call>\n{{"name": "get_weather", "arguments": {CALL_ARGS}}}\n</tool_call>',
    "llama3": f'{{"name": "get_weather", "parameters": {CALL_ARGS}}}',
    "mistral": f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {CALL_ARGS}}}]',
    "deepseekv3": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
                   f"```json\n{CALL_ARGS}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
}


@dataclass
class Deployment:
    model_dir: Path
    worker: Proc
    gateways: dict[str, Proc]  # by tool call parser: "qwen25" learned from the worker

    def client(self, parser: str = "qwen25") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://{self.gateways[parser].address}/v1", api_key="unused",
                             max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    from tools.models.tiny_model import write_tiny_model

    model_dir = write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-tools", preset="tiny", seed=0)
    (model_dir / "chat_template.jinja").write_text(TEMPLATE)
    with Cluster(tmp_path_factory.mktemp("chat-tools")) as cluster:
        worker = cluster.start("worker", [*worker_args(model_dir, "null", None),
                                          "--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3"])
        router = ["launch-router", "--port", "0", "--worker", f"http://{worker.address}"]
        names = ["qwen25", "llama3", "mistral", "deepseekv3"]
        started = cluster.start_many([(f"gateway-{name}", router if name == "qwen25" else
                                       [*router, "--tool-call-parser", name]) for name in names])
        try:
            yield Deployment(model_dir, worker, dict(zip(names, started, strict=True)))
        except BaseException:
            print(cluster.logs())
            raise


def _stream(client: openai.OpenAI, **request) -> dict:
    """The streamed answer assembled as a client does: text parts and calls by index."""
    out: dict = {"content": "", "reasoning": "", "calls": [], "finish_reason": None}
    for chunk in client.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            delta = choice.delta
            out["content"] += delta.content or ""
            out["reasoning"] += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:
                if call.id is not None:
                    assert call.index == len(out["calls"]) and call.function.name
                    out["calls"].append({"name": call.function.name, "arguments": ""})
                out["calls"][call.index]["arguments"] += call.function.arguments or ""
            out["finish_reason"] = choice.finish_reason or out["finish_reason"]
    return out


def _whole(client: openai.OpenAI, **request) -> dict:
    choice = client.chat.completions.create(**request).choices[0]
    message = choice.message
    return {"content": message.content or "", "reasoning": getattr(message, "reasoning_content", None) or "",
            "calls": [{"name": call.function.name, "arguments": call.function.arguments}
                      for call in message.tool_calls or []],
            "finish_reason": choice.finish_reason}


def test_history_with_tool_calls_and_results_is_rendered_by_the_template(deployment: Deployment) -> None:
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": CALL_ARGS}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 18 degrees"}]
    model = deployment.model_dir.name
    files = ModelFiles(deployment.model_dir)
    assert files.chat_template is not None

    def prompt_tokens(messages: list, tools: list | None, **kwargs) -> int:
        text = files.chat_template.render(messages, tools=tools, extra=kwargs.get("chat_template_kwargs"))
        return len(files.encode(text, add_special_tokens=False))

    for tools, choice in ((TOOLS, "auto"), (None, None), (TOOLS, "none")):
        request = {"model": model, "messages": history, "max_tokens": 2, "temperature": 0,
                   "extra_body": NO_THINKING}
        if tools is not None:
            request |= {"tools": tools, "tool_choice": choice}
        usage = deployment.client().chat.completions.create(**request).usage
        assert usage is not None
        shown = tools if choice == "auto" else None  # tool_choice none keeps the tools out of the prompt
        assert usage.prompt_tokens == prompt_tokens(history, shown, chat_template_kwargs=NO_THINKING[
            "chat_template_kwargs"])
    assert prompt_tokens(history, None) != prompt_tokens(ASK, None)


def test_tool_choice_naming_no_tool_is_a_400(deployment: Deployment) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        deployment.client().chat.completions.create(
            model=deployment.model_dir.name, messages=ASK, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_stock_price"}})
    assert "get_stock_price" in str(raised.value) and "not among the tools" in str(raised.value)
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        deployment.client().chat.completions.create(model=deployment.model_dir.name, messages=ASK,
                                                    tool_choice="required")


def test_thinking_is_reasoning_content_streamed_and_not(deployment: Deployment) -> None:
    # the template opens <think> in the prompt; the random model never closes it: all of it is thinking
    request = {"model": deployment.model_dir.name, "messages": ASK, "max_tokens": 12, "temperature": 0}
    whole = _whole(deployment.client(), **request)
    assert whole["reasoning"] and whole["content"] == "" and whole["finish_reason"] == "length"
    assert _stream(deployment.client(), **request) == whole
    # thinking off: the same gateway leaves the text as content
    plain = _whole(deployment.client(), **request, extra_body=NO_THINKING)
    assert plain["content"] and plain["reasoning"] == ""


def _grammar_enforced(deployment: Deployment) -> bool:
    """Whether the worker enforces structured outputs (its grammar engine is present)."""
    forced = "the forced words"
    try:
        answer = deployment.client().chat.completions.create(
            model=deployment.model_dir.name, messages=ASK, max_tokens=16, temperature=0,
            extra_body={**NO_THINKING, "structured_outputs": {"choice": [forced]}})
    except openai.BadRequestError:
        return False
    return answer.choices[0].message.content == forced


@pytest.fixture(scope="module")
def grammar(deployment: Deployment) -> None:
    if not _grammar_enforced(deployment):
        pytest.skip("this build's workers do not enforce structured outputs")


@pytest.mark.parametrize("parser", sorted(FORCED))
def test_auto_parses_a_call_written_in_each_format(deployment: Deployment, grammar: None,
                                                   parser: str) -> None:
    forced = {**NO_THINKING, "structured_outputs": {"choice": [FORCED[parser]]}}
    request = {"model": deployment.model_dir.name, "messages": ASK, "tools": TOOLS, "max_tokens": 240,
               "temperature": 0, "extra_body": forced}
    whole = _whole(deployment.client(parser), **request)
    assert whole["calls"] == [{"name": "get_weather", "arguments": CALL_ARGS}], whole
    assert (whole["content"], whole["finish_reason"]) == ("", "tool_calls")
    assert _stream(deployment.client(parser), **request) == whole


# parallel calls are an array the random model may go on filling: up to 3 tools it ends within the budget
@pytest.mark.parametrize(("tools", "parallel"), [(2, False), (5, False), (2, True), (3, True)])
def test_required_calls_validate_against_their_tools(deployment: Deployment, grammar: None, tools: int,
                                                     parallel: bool) -> None:
    request = {"model": deployment.model_dir.name, "messages": ASK, "tools": TOOLS[:tools],
               "tool_choice": "required", "parallel_tool_calls": parallel, "max_tokens": 160,
               "temperature": 0, "extra_body": NO_THINKING}
    whole = _whole(deployment.client(), **request)
    assert whole["finish_reason"] == "tool_calls" and whole["calls"], whole
    assert parallel or len(whole["calls"]) == 1
    for call in whole["calls"]:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    assert _stream(deployment.client(), **request) == whole


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_named_call_validates_against_its_tool(deployment: Deployment, grammar: None, name: str) -> None:
    request = {"model": deployment.model_dir.name, "messages": ASK, "tools": TOOLS, "max_tokens": 120,
               "tool_choice": {"type": "function", "function": {"name": name}}, "temperature": 0,
               "extra_body": NO_THINKING}
    whole = _whole(deployment.client(), **request)
    assert [call["name"] for call in whole["calls"]] == [name] and whole["finish_reason"] == "tool_calls"
    jsonschema.validate(json.loads(whole["calls"][0]["arguments"]), SCHEMAS[name])
    assert _stream(deployment.client(), **request) == whole
    # with thinking on, the constraint starts after </think>, which the random model never writes
    thinking = _whole(deployment.client(), **{**request, "extra_body": {}, "max_tokens": 8})
    assert thinking["calls"] == [] and thinking["reasoning"]


@pytest.mark.long
def test_pd_answers_tool_calls_as_colocated(deployment: Deployment, grammar: None,
                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    """A prefill and a decode worker (mooncake) with the same parser flags behind a gateway that learns
    them: greedy required and named calls, streamed and not, equal the colocated ones."""
    with Cluster(tmp_path_factory.mktemp("chat-tools-pd")) as cluster:
        flags = ["--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3"]
        prefill, decode = cluster.start_many([
            ("prefill", [*worker_args(deployment.model_dir, "prefill", None), *flags]),
            ("decode", [*worker_args(deployment.model_dir, "decode", None), *flags])])
        gateway = cluster.start("gateway", ["launch-router", "--port", "0",
                                            "--prefill", f"http://{prefill.address}",
                                            "--decode", f"http://{decode.address}"])
        pd = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", max_retries=0,
                           timeout=120)
        for choice in ("required", {"type": "function", "function": {"name": "add"}}):
            # parallel calls (the default): over 3 tools the random model ends its array within budget
            request = {"model": deployment.model_dir.name, "messages": ASK, "tools": TOOLS[:3],
                       "tool_choice": choice, "max_tokens": 160, "temperature": 0, "extra_body": NO_THINKING}
            colocated = _whole(deployment.client(), **request)
            assert colocated["calls"]
            assert _whole(pd, **request) == colocated
            assert _stream(pd, **request) == colocated
