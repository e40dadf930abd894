"""`--tool-call-parser` and `--reasoning-parser` (SGLang's names), on launch-server and launch-router
alike. The parsers run in the gateway (services/gateway/tool_parsers, reasoning_parsers); a worker
only checks the names and reports them with its model (Worker.GetModelInfo), so that a gateway
learns them as it learns the model. A name given to launch-router wins over the workers'."""

from __future__ import annotations

from dataclasses import dataclass, field

TOOL_CALL_PARSER_NAMES = ("qwen25", "qwen", "llama3", "mistral", "deepseekv3")
REASONING_PARSER_NAMES = ("deepseek-r1", "qwen3", "qwen3-thinking")


@dataclass(frozen=True)
class TextParsers:
    """Nested in WorkerConfig and GatewayConfig; its fields are flags of both commands."""

    tool_call_parser: str | None = field(default=None, metadata={"help": (
        "how the model writes tool calls, read by the gateway for tool_choice auto: "
        f"{' | '.join(TOOL_CALL_PARSER_NAMES)}; unset: tool calls are not parsed (the text is content)")})
    reasoning_parser: str | None = field(default=None, metadata={"help": (
        "how a thinking model marks its thinking, split by the gateway into reasoning_content: "
        f"{' | '.join(REASONING_PARSER_NAMES)}; unset: the thinking stays in content")})

    def __post_init__(self) -> None:
        if self.tool_call_parser and self.tool_call_parser not in TOOL_CALL_PARSER_NAMES:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSER_NAMES)}, "
                             f"got {self.tool_call_parser!r}")
        if self.reasoning_parser and self.reasoning_parser not in REASONING_PARSER_NAMES:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSER_NAMES)}, "
                             f"got {self.reasoning_parser!r}")

    def over(self, reported: TextParsers) -> TextParsers:
        """These names where given, else the `reported` ones (a router's flags over its workers')."""
        return TextParsers(self.tool_call_parser or reported.tool_call_parser,
                           self.reasoning_parser or reported.reasoning_parser)
