"""argparse flags generated from a frozen config dataclass, so each default lives in one place.

A field `heartbeat_interval: float = field(default_factory=envs.HEARTBEAT_INTERVAL.get,
metadata={"help": "..."})` becomes `--heartbeat-interval FLOAT` whose default is the field's
default (a factory is called when the parser is built, so environment knobs are read at start-up,
not on import). bool fields become `--flag/--no-flag`. A field without a default becomes a
required flag. `metadata={"flags": ("--a", "--b")}` spells a field's flag otherwise (several
spellings: aliases, the first is the one help shows first).

A field whose type is itself a config dataclass (a sub-config: the engine's settings in a worker's
config, the security flags every service shares) contributes its own fields' flags, unprefixed, and
is rebuilt from them. Their defaults are the sub-config's own, or, when the nesting field has a
default, that default instance's values, so a service can pick its own default for a shared setting
in its own config. The nesting field's metadata may also hold:
  "defaults": {"name": value}  this command's default for some sub-config fields (for a sub-config
                               without a default instance, e.g. one with a required field);
  "omit": ("name", ...)        sub-config fields this command has no flag for: they keep their
                               default.
Every flag's destination is its field's name, so two fields of one name anywhere in the tree are
refused when the parser is built.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar

C = TypeVar("C")

_SCALARS = (int, float, str, bool)
_REQUIRED = object()  # "no default": the flag must be given


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
    """The field's default (its factory called), or _REQUIRED when it has none."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return _REQUIRED


def _flag_fields(config_cls: type,
                 defaults: dict[str, Any]) -> typing.Iterator[tuple[dataclasses.Field, Any, Any]]:
    """(field, type hint, default) of every field of `config_cls` a caller can set."""
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        if f.init:
            yield f, hints[f.name], defaults[f.name] if f.name in defaults else field_default(f)


def _sub_defaults(f: dataclasses.Field, default: Any) -> dict[str, Any]:
    """The defaults a nested sub-config's flags get: its nesting field's default instance, then the
    nesting field's "defaults" metadata."""
    values = {} if default is _REQUIRED else {s.name: getattr(default, s.name)
                                              for s in dataclasses.fields(default) if s.init}
    return {**values, **f.metadata.get("defaults", {})}


def add_config_arguments(parser: argparse.ArgumentParser, config_cls: type) -> None:
    """Add one `--field-name` flag per field of `config_cls` (a dataclass)."""
    _add_arguments(parser, config_cls, {}, (), set())


def config_from_args(config_cls: type[C], args: argparse.Namespace) -> C:
    """Build `config_cls` from the flags `add_config_arguments` added."""
    return _from_args(config_cls, args, {}, ())


def _add_arguments(parser: argparse.ArgumentParser, config_cls: type, defaults: dict[str, Any],
                   omit: tuple[str, ...], dests: set[str]) -> None:
    for f, hint, default in _flag_fields(config_cls, defaults):
        if f.name in omit:
            continue
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            _add_arguments(parser, hint, _sub_defaults(f, default), tuple(f.metadata.get("omit", ())), dests)
            continue
        if f.name in dests:
            raise TypeError(f"two config fields are named {f.name!r}: their flags would share one "
                            "destination")
        dests.add(f.name)
        flags = tuple(f.metadata.get("flags", ("--" + f.name.replace("_", "-"),)))
        help_ = f.metadata.get("help", "")
        if hint in (tuple[str, ...], tuple[int, ...]):  # values after the flag, as SGLang's --encoder-urls
            item: type = int if hint == tuple[int, ...] else str
            parser.add_argument(*flags, dest=f.name, nargs="+", type=item, default=default,
                                metavar=item.__name__.upper(),
                                help=f"{help_} (default: {' '.join(map(str, default)) or 'none'})")
            continue
        kind, nullable = _scalar_type(hint)
        if default is _REQUIRED:
            parser.add_argument(*flags, dest=f.name, type=kind, required=True, metavar=kind.__name__.upper(),
                                help=help_)
        elif kind is bool:
            parser.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                                help=help_)
        else:
            parser.add_argument(*flags, dest=f.name, type=kind, default=default,
                                metavar=kind.__name__.upper(),
                                help=f"{help_} (default: {default}{', or unset' if nullable else ''})")


def _from_args(config_cls: type[C], args: argparse.Namespace, defaults: dict[str, Any],
               omit: tuple[str, ...]) -> C:
    values = {}
    for f, hint, default in _flag_fields(config_cls, defaults):
        if f.name in omit:
            if f.name in defaults:  # this command's default for a field it has no flag for
                values[f.name] = defaults[f.name]
        elif isinstance(hint, type) and dataclasses.is_dataclass(hint):
            values[f.name] = _from_args(hint, args, _sub_defaults(f, default),
                                        tuple(f.metadata.get("omit", ())))
        elif hint in (tuple[str, ...], tuple[int, ...]):
            values[f.name] = tuple(getattr(args, f.name) or ())
        else:
            values[f.name] = getattr(args, f.name)
    return config_cls(**values)
