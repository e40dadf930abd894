"""argparse flags generated from a frozen config dataclass, so each default lives in one place.

A field `heartbeat_interval: float = field(default_factory=envs.HEARTBEAT_INTERVAL.get,
metadata={"help": "..."})` becomes `--heartbeat-interval FLOAT` whose default is the field's
default (a factory is called when the parser is built, so environment knobs are read at start-up,
not on import). bool fields become `--flag/--no-flag`. A field whose type is itself a config
dataclass (a sub-config shared by several services, e.g. GrpcSecurity) contributes its own fields'
flags, unprefixed, and is rebuilt from them. `metadata={"flags": ("--a", "--b")}` spells a field's
flag otherwise (several spellings: aliases, the first is the one help shows first).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar

C = TypeVar("C")

_SCALARS = (int, float, str, bool)


def _scalar_type(annotation: Any) -> tuple[type, bool]:
    """(scalar type, accepts None) of an annotation like `int`, `str | None`, `Optional[float]`."""
    if annotation in _SCALARS:
        return annotation, False
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1 and args[0] in _SCALARS:
            return args[0], True
    raise TypeError(f"config field type {annotation!r} has no command-line form")


def field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"config field {f.name!r} needs a default to become a flag")


def add_config_arguments(parser: argparse.ArgumentParser, config_cls: type) -> None:
    """Add one `--field-name` flag per field of `config_cls` (a dataclass)."""
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        if not f.init:
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            add_config_arguments(parser, hints[f.name])
            continue
        kind, nullable = _scalar_type(hints[f.name])
        default = field_default(f)
        flags = tuple(f.metadata.get("flags", ("--" + f.name.replace("_", "-"),)))
        help_ = f.metadata.get("help", "")
        if kind is bool:
            parser.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                                help=help_)
        else:
            parser.add_argument(*flags, dest=f.name, type=kind, default=default,
                                metavar=kind.__name__.upper(),
                                help=f"{help_} (default: {default}{', or unset' if nullable else ''})")


def config_from_args(config_cls: type[C], args: argparse.Namespace) -> C:
    """Build `config_cls` from the flags `add_config_arguments` added."""
    hints = typing.get_type_hints(config_cls)
    values = {}
    for f in dataclasses.fields(config_cls):
        if not f.init:
            continue
        sub = hints[f.name]
        values[f.name] = config_from_args(sub, args) if dataclasses.is_dataclass(sub) else getattr(args, f.name)
    return config_cls(**values)
