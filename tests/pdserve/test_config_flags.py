"""Flags generated from a frozen config dataclass: types, defaults, factories, bools, Optional,
required fields and nested sub-configs."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from pdserve.config_flags import add_config_arguments, config_from_args
from services.bootstrap.config import BootstrapConfig


@dataclass(frozen=True)
class DemoConfig:
    host: str = field(default="127.0.0.1", metadata={"help": "bind address"})
    port: int = 0
    ratio: float = 0.5
    verbose: bool = False
    limit: int | None = None
    sampled: float = field(default_factory=lambda: 2.5)


def parse(config_cls: type, argv: list[str]):
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, config_cls)
    return config_from_args(config_cls, parser.parse_args(argv))


def test_defaults_come_from_fields() -> None:
    assert parse(DemoConfig, []) == DemoConfig()


def test_flags_parse_to_typed_fields() -> None:
    config = parse(DemoConfig, ["--host", "0.0.0.0", "--port", "7", "--ratio", "0.25", "--verbose",
                                "--limit", "3", "--sampled", "1"])
    assert config == DemoConfig("0.0.0.0", 7, 0.25, True, 3, 1.0)
    assert parse(DemoConfig, ["--no-verbose"]).verbose is False
    with pytest.raises(SystemExit):
        parse(DemoConfig, ["--port", "seven"])


def test_bootstrap_heartbeat_defaults_read_from_env_at_parser_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_DISAGGREGATION_HEARTBEAT_INTERVAL", "0.5")
    monkeypatch.setenv("PDSERVE_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", "4")
    config = parse(BootstrapConfig, ["--port", "0"])
    assert (config.server.port, config.heartbeat_interval, config.heartbeat_max_failure) == (0, 0.5, 4)
    assert parse(BootstrapConfig, ["--heartbeat-interval", "2"]).heartbeat_interval == 2.0
    with pytest.raises(ValueError, match="heartbeat_interval must be positive"):
        parse(BootstrapConfig, ["--heartbeat-interval", "0"])


@dataclass(frozen=True, kw_only=True)
class InnerConfig:
    path: str = field(metadata={"help": "required: no default"})
    size: int = 16
    mode: str = "cpu"
    hidden: float = 2.0


@dataclass(frozen=True, kw_only=True)
class OuterConfig:
    inner: InnerConfig = field(metadata={"defaults": {"mode": "auto"}, "omit": ("hidden",)})
    demo: DemoConfig = field(default_factory=lambda: DemoConfig(port=8998))
    name: str = field(default="x", metadata={"flags": ("--served-name", "--name")})


def test_nested_configs_flags_are_unprefixed_with_this_commands_defaults() -> None:
    config = parse(OuterConfig, ["--path", "p"])
    # The nesting field's default instance and its "defaults" metadata set the flags' defaults;
    # an omitted field has no flag and keeps the sub-config's default.
    assert config == OuterConfig(inner=InnerConfig(path="p", mode="auto"), demo=DemoConfig(port=8998))
    config = parse(OuterConfig, ["--path", "p", "--size", "4", "--mode", "cpu", "--port", "1", "--name", "y"])
    assert config == OuterConfig(inner=InnerConfig(path="p", size=4), demo=DemoConfig(port=1), name="y")
    with pytest.raises(SystemExit):
        parse(OuterConfig, ["--hidden", "1"])


def test_a_field_without_default_is_a_required_flag() -> None:
    with pytest.raises(SystemExit):
        parse(OuterConfig, [])


def test_two_fields_of_one_name_are_refused() -> None:
    @dataclass(frozen=True)
    class Clash:
        demo: DemoConfig = field(default_factory=DemoConfig)
        port: int = 1

    with pytest.raises(TypeError, match="'port'"):
        add_config_arguments(argparse.ArgumentParser(), Clash)
