"""What a chat request's `tools`, `tool_choice` and `parallel_tool_calls` ask of the output (OpenAI's
fields), checked before the request waits for admission.

`none` (the default without tools): no tools reach the chat template and the text is content.
`auto` (the default with tools): the template sees the tools, and the gateway's --tool-call-parser
finds calls in what the model wrote. `required` and a named function constrain the output with a
JSON schema built from the tools' parameter schemas (sent as the structured output), so the call is
valid by construction, as vLLM does: a named function's output is its arguments object; `required`'s
is an array of {"name", "parameters"} objects, one schema per tool in an anyOf, at most one item
unless parallel_tool_calls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.gateway.errors import bad_request
from services.gateway.fields import JsonObject, Text


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


# OpenAI's rule for function names
FunctionNameText = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class FunctionName(_Body):
    name: FunctionNameText


class Function(_Body):
    """A tool's function: `parameters` is the JSON Schema of its arguments (an object of anything
    when absent)."""

    name: FunctionNameText
    description: Text | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None


class Tool(_Body):
    """One entry of `tools` (OpenAI's only kind: a function)."""

    type: Literal["function"]
    function: Function

    def template_dict(self) -> dict[str, Any]:
        """The tool as chat templates read it (transformers passes the request's dicts)."""
        return self.model_dump(exclude_none=True)


class NamedToolChoice(_Body):
    """tool_choice naming the function to call: {"type": "function", "function": {"name": ...}}."""

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice

# The document's half of plan_tools' checks: `required` and a named function need tools, and take
# the output's one constraint (no response_format other than text, no structured_outputs). That the
# named function is one of the tools stays outside it (JSON Schema cannot compare two fields' values).
TOOL_CHOICE_NEEDS_TOOLS: dict[str, Any] = {"allOf": [{
    "if": {"required": ["tool_choice"],
           "properties": {"tool_choice": {"not": {"enum": ["none", "auto", None]}}}},
    "then": {"required": ["tools"], "properties": {
        "tools": {"type": "array", "minItems": 1},
        "structured_outputs": {"type": "null"},
        "response_format": {"anyOf": [{"type": "null"}, {"properties": {"type": {"const": "text"}}}]}}}}]}

# a function without a parameters schema takes an object of anything
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    """`mode`: none | auto | required | named. `function`: the named one. `schema`: the JSON schema
    the output is held to (required and named). `template_tools`: what the chat template sees."""

    mode: str
    function: str | None = None
    schema: dict[str, Any] | None = None
    template_tools: list[dict[str, Any]] | None = None


def _functions(tools: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each tool's parameters schema by function name; 400 naming the first malformed tool."""
    functions: dict[str, dict[str, Any]] = {}
    for position, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, Mapping):
            raise bad_request(f'tools[{position}] is not {{"type": "function", "function": {{...}}}}',
                              param=f"tools[{position}]")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{position}].function.name must be a non-empty string",
                              param=f"tools[{position}].function.name")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise bad_request(f"tools[{position}].function.parameters must be a JSON Schema object",
                              param=f"tools[{position}].function.parameters")
        functions[name] = dict(parameters) if parameters else dict(_ANY_OBJECT)
    return functions


def plan_tools(tools: Sequence[Mapping[str, Any]] | None, tool_choice: ToolChoice | None,
               parallel_tool_calls: bool) -> ToolPlan:
    """The request's ToolPlan; 400 for a malformed tool, a tool_choice without tools, or one naming
    a function that is not among them."""
    functions = _functions(tools or ())
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none" or (tool_choice == "auto" and not tools):
        return ToolPlan("none")
    if not tools:
        raise bad_request(f"tool_choice {_shown(tool_choice)} needs tools", param="tool_choice")
    template_tools = [dict(tool) for tool in tools]
    if tool_choice == "auto":
        return ToolPlan("auto", template_tools=template_tools)
    if tool_choice == "required":
        return ToolPlan("required", schema=required_schema(functions, parallel_tool_calls),
                        template_tools=template_tools)
    name = tool_choice.function.name
    if name not in functions:
        raise bad_request(f"tool_choice names function {name!r}, which is not among the tools "
                          f"({', '.join(repr(known) for known in functions)})", param="tool_choice")
    return ToolPlan("named", function=name, schema=functions[name], template_tools=template_tools)


def required_schema(functions: Mapping[str, dict[str, Any]], parallel_tool_calls: bool) -> dict[str, Any]:
    """The schema of `required`'s output: [{"name": N, "parameters": {...}}, ...], each item one of
    the functions with its own parameters schema and nothing else (another key would let a weak
    model ramble inside the call until max_tokens)."""
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, parameters in functions.items()]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def _shown(tool_choice: ToolChoice) -> str:
    return repr(tool_choice) if isinstance(tool_choice, str) else f"function {tool_choice.function.name!r}"
