"""Tool call parsers, by SGLang's --tool-call-parser names: each turns a model's text into content
and tool calls in its model family's format (base.py says what a parser promises)."""

from __future__ import annotations

from services.gateway.tool_parsers import deepseekv3, hermes, llama3, mistral
from services.gateway.tool_parsers.base import ParsedTools, ToolCallParse
from services.gateway.tool_parsers.deepseekv3 import parse_deepseekv3
from services.gateway.tool_parsers.hermes import parse_hermes
from services.gateway.tool_parsers.llama3 import parse_llama3
from services.gateway.tool_parsers.mistral import parse_mistral

TOOL_CALL_PARSERS: dict[str, ToolCallParse] = {
    "qwen25": parse_hermes,
    "qwen": parse_hermes,
    "llama3": parse_llama3,
    "mistral": parse_mistral,
    "deepseekv3": parse_deepseekv3,
}

# the marker texts each format's parser reads (kept in the output text when they are special
# tokens: services/gateway/marker_tokens.py)
TOOL_CALL_MARKERS: dict[str, tuple[str, ...]] = {
    "qwen25": (hermes.OPEN, hermes.CLOSE),
    "qwen": (hermes.OPEN, hermes.CLOSE),
    "llama3": (llama3.PYTHON_TAG,),
    "mistral": mistral.MARKERS,
    "deepseekv3": (deepseekv3.CALLS_BEGIN, deepseekv3.CALLS_END, deepseekv3.CALL_BEGIN, deepseekv3.CALL_END,
                   deepseekv3.SEP),
}

__all__ = ["TOOL_CALL_MARKERS", "TOOL_CALL_PARSERS", "ParsedTools", "ToolCallParse"]
