"""Worker addresses in the seeds' forms and the launch-router flags."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdserve.config_flags import config_from_args
from services.gateway.addresses import grpc_address
from services.gateway.config import (
    GatewayConfig,
    StaticWorker,
    add_worker_arguments,
    static_workers_from_args,
)
from services.gateway.main import add_arguments


@pytest.mark.parametrize("url, expected", [
    ("http://127.0.0.1:30000", "127.0.0.1:30000"),
    ("http://127.0.0.1:30000/", "127.0.0.1:30000"),
    ("grpc://worker-1:8001", "worker-1:8001"),
    ("https://h:1", "h:1"),
    ("10.0.0.2:9000", "10.0.0.2:9000"),
    ("[::1]:30000", "[::1]:30000"),
])
def test_grpc_address_forms(url: str, expected: str) -> None:
    assert grpc_address(url) == expected


@pytest.mark.parametrize("url, message", [
    ("http://127.0.0.1", "expected host:port"),
    ("ftp://h:1", "scheme must be one of"),
    ("http://h:1/v1", "no path"),
    ("h:notaport", "worker address"),
])
def test_grpc_address_rejects(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        grpc_address(url)


def test_seed_router_command_line(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([
        "--pd-disaggregation", "--prefill", "http://127.0.0.1:30000", "8998", "--prefill",
        "http://127.0.0.1:30001",
        "--decode", "http://127.0.0.1:30002", "--worker", "127.0.0.1:30003", "--policy", "cache_aware",
        "--decode-policy", "round_robin", "--host", "0.0.0.0", "--port", "8000", "--model-path",
        str(tmp_path)])
    assert static_workers_from_args(args) == (
        StaticWorker("prefill", "127.0.0.1:30000"), StaticWorker("prefill", "127.0.0.1:30001"),
        StaticWorker("decode", "127.0.0.1:30002"), StaticWorker("colocated", "127.0.0.1:30003"))
    config = config_from_args(GatewayConfig, args)
    assert (config.prefill_policy_name, config.decode_policy_name) == ("cache_aware", "round_robin")
    assert config.served_model_name == tmp_path.name and config.port == 8000 and config.pd_disaggregation


def test_seed_router_command_needs_no_model_path() -> None:
    """The seeds' router command verbatim: the gateway learns the model from the workers."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([
        "--pd-disaggregation", "--prefill", "http://127.0.0.1:30000", "8998", "--decode",
        "http://127.0.0.1:30001",
        "--policy", "round_robin", "--host", "0.0.0.0", "--port", "8000"])
    config = config_from_args(GatewayConfig, args)
    assert config.model_path == "" and config.served_model_name is None
    for flag in ("--served-model-name", "--model-name"):
        assert config_from_args(GatewayConfig, parser.parse_args([flag, "m"])).served_model_name == "m"


def test_bad_flags(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    with pytest.raises(ValueError, match="bootstrap port must be a number"):
        static_workers_from_args(parser.parse_args(["--prefill", "h:1", "x"]))
    assert GatewayConfig().served_model_name is None  # learned from the workers (model_source)
    assert GatewayConfig(model_name="m").served_model_name == "m"
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        GatewayConfig(model_path=str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="--policy must be one of"):
        GatewayConfig(model_path=str(tmp_path), policy="fastest")


def test_api_key_comes_from_the_flag_or_the_environment_and_never_shows(
        tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.config_flags import config_from_args
    from services.gateway.config import with_env_api_key

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    args = parser.parse_args(["--model-path", str(tiny_model)])
    config = with_env_api_key(config_from_args(GatewayConfig, args))
    assert config.api_key == "from-env"
    assert "from-env" not in repr(config) and "from-env" not in parser.format_help()
    flagged = with_env_api_key(config_from_args(GatewayConfig, parser.parse_args(
        ["--model-path", str(tiny_model), "--api-key", "from-flag"])))
    assert flagged.api_key == "from-flag"  # the flag wins
    monkeypatch.delenv("PDSERVE_API_KEY")
    assert with_env_api_key(config_from_args(GatewayConfig, args)).api_key is None


@pytest.mark.parametrize("field, value, message", [
    ("api_key", " ", "--api-key"),
    ("max_request_body_bytes", 0, "--max-request-body-bytes"),
    ("max_generations_per_request", 0, "--max-generations-per-request"),
    ("max_concurrent_requests", -1, "--max-concurrent-requests"),
    ("queue_timeout", 0.0, "--queue-timeout"),
    ("queue_size", -1, "--queue-size"),
])
def test_limit_flags_are_checked(tiny_model: Path, field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GatewayConfig(model_path=str(tiny_model), **{field: value})
