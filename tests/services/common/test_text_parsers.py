"""--tool-call-parser and --reasoning-parser: the names both commands take, what a worker reports in
its ModelInfo, and the router's own names winning over the reported ones."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdserve.config_flags import add_config_arguments, config_from_args
from protos.v1 import worker_pb2
from services.common.model_info import read_model_info, reported_text_parsers
from services.common.text_parsers import TextParsers
from services.gateway.config import GatewayConfig


def test_unknown_names_are_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="--tool-call-parser must be one of qwen25, qwen, llama3"):
        TextParsers(tool_call_parser="hermes2")
    with pytest.raises(ValueError, match="--reasoning-parser must be one of deepseek-r1"):
        TextParsers(reasoning_parser="r1")


def test_a_worker_reports_its_parsers_with_its_model(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    info = read_model_info(tmp_path, "m", TextParsers("llama3", "qwen3"))
    assert (info.tool_call_parser, info.reasoning_parser) == ("llama3", "qwen3")
    assert reported_text_parsers(info) == TextParsers("llama3", "qwen3")
    assert read_model_info(tmp_path, "m").tool_call_parser == ""
    # a name this gateway does not know (a newer worker's) is not used
    assert reported_text_parsers(worker_pb2.ModelInfo(tool_call_parser="future")) == TextParsers()


def test_router_flags_win_over_the_workers(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, GatewayConfig)
    config = config_from_args(GatewayConfig, parser.parse_args(["--tool-call-parser", "mistral"]))
    reported = TextParsers("qwen25", "deepseek-r1")
    assert config.text_parsers.over(reported) == TextParsers("mistral", "deepseek-r1")
    assert TextParsers().over(reported) == reported
