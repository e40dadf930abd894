"""The names `--tool-call-parser` and `--reasoning-parser` take (SGLang's), on launch-server and
launch-router alike. The parsers themselves run in the gateway (services/gateway/tool_parsers,
services/gateway/reasoning_parsers); a worker only checks the name and reports it with its model
(Worker.GetModelInfo), so that a gateway learns it as it learns the model."""

from __future__ import annotations

TOOL_CALL_PARSER_NAMES = ("qwen25", "qwen", "llama3", "mistral", "deepseekv3")
REASONING_PARSER_NAMES = ("deepseek-r1", "qwen3", "qwen3-thinking")


def check_parser_names(tool_call_parser: str | None, reasoning_parser: str | None) -> None:
    """ValueError naming the flag and the choices when a name is not one of them."""
    if tool_call_parser and tool_call_parser not in TOOL_CALL_PARSER_NAMES:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSER_NAMES)}, "
                         f"got {tool_call_parser!r}")
    if reasoning_parser and reasoning_parser not in REASONING_PARSER_NAMES:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSER_NAMES)}, "
                         f"got {reasoning_parser!r}")
