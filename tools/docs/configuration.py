"""docs/configuration.md, generated from the parsers the commands build and from the env registry.

    python -m tools.docs.configuration > docs/configuration.md   # regenerate the page
    python -m tools.docs.configuration --check                    # exit 1 if the committed page is stale

Each command's parser is built the way `pdserve` builds it (pdserve/cli.py's COMMANDS names the
module, the module's `add_arguments` fills the parser), so a flag added to a config dataclass shows
up here with its spellings, default and help. The environment variables come from pdserve/envs.py's
`ALL`. The page must not depend on the machine that renders it, so the parsers are built with every
declared variable unset, and a default the code computes from the machine is shown as its rule
(`_MACHINE_DEFAULTS`). A flag whose default comes from a variable is found by building the parsers
again with that one variable set to a probe value and seeing which defaults move.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pdserve import envs
from pdserve.cli import COMMANDS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
REGENERATE = "python -m tools.docs.configuration > docs/configuration.md"
DOCUMENTED_COMMANDS = ("launch-server", "launch-router", "bootstrap")

# Defaults the code computes from the machine it runs on, as the rule that computes them.
_MACHINE_DEFAULTS = {
    envs.THREAD_POOL_SIZE.name: "min(max(int(0.75 x CPUs) // 8, 4), 12): 4 below 64 CPUs",
}
# config_flags appends "(default: X)" to a help text; the page shows the default in its own column.
_DEFAULT_SUFFIX = re.compile(r"\s*\(default: [^)]*\)$")


@dataclass(frozen=True)
class Flag:
    """One command-line option as the page shows it."""

    spellings: tuple[str, ...]
    value: str  # what follows the flag ("INT", "URL [BOOTSTRAP_PORT]"), empty for a switch
    repeatable: bool
    required: bool
    default: object
    help: str


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """Every declared variable unset, except `values`; the caller's environment comes back after."""
    saved = {v.name: os.environ.pop(v.name) for v in envs.ALL if v.name in os.environ}
    os.environ.update(values)
    try:
        yield
    finally:
        for name in values:
            os.environ.pop(name, None)
        os.environ.update(saved)


def build_parser(command: str) -> argparse.ArgumentParser:
    """The parser `pdserve COMMAND` parses its arguments with."""
    module_name, help_ = COMMANDS[command]
    parser = argparse.ArgumentParser(prog=f"pdserve {command}", description=help_)
    importlib.import_module(module_name).add_arguments(parser)
    return parser


def flags(command: str) -> list[Flag]:
    with _environment():
        parser = build_parser(command)
    found = []
    for action in parser._actions:  # argparse has no public way to list a parser's options
        if isinstance(action, argparse._HelpAction):
            continue
        metavar = action.metavar
        value = " ".join(metavar) if isinstance(metavar, tuple) else (metavar or "")
        if action.nargs == 0:
            value = ""
        found.append(Flag(tuple(action.option_strings), value, isinstance(action, argparse._AppendAction),
                          action.required, action.default, _DEFAULT_SUFFIX.sub("", action.help or "")))
    return found


def _probe_value(var: envs.EnvVar) -> str:
    """A valid value for `var` that differs from its default."""
    if isinstance(var.default, bool):
        return "0" if var.default else "1"
    if isinstance(var.default, (int, float)):
        return str(var.default + 7919)
    return var.default + "-probe"


def env_links() -> dict[tuple[str, str], list[str]]:
    """(command, first spelling of a flag) -> names of the variables its default is read from."""
    with _environment():
        baseline = {c: {f.spellings[0]: f.default for f in flags(c)} for c in DOCUMENTED_COMMANDS}
    links: dict[tuple[str, str], list[str]] = {}
    for var in envs.ALL:
        with _environment(**{var.name: _probe_value(var)}):
            try:
                parsers = {c: build_parser(c) for c in DOCUMENTED_COMMANDS}
            except ValueError:
                # A variable whose value is checked when read (a file that must exist, a key that
                # needs its certificate) cannot be probed with a made-up value; its own doc names
                # the flag it stands for.
                continue
        for command, parser in parsers.items():
            for action in parser._actions:
                if action.option_strings and action.option_strings[0] in baseline[command] \
                        and action.default != baseline[command][action.option_strings[0]]:
                    links.setdefault((command, action.option_strings[0]), []).append(var.name)
    return links


def _cell(text: str) -> str:
    """Text safe in a Markdown table cell: `|` ends a cell, `<name>` would read as an HTML tag."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;").replace("\n", " ")


def _show(value: object) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if value == "":
        return "empty"
    if value in ([], ()):
        return "none"
    return f"`{value}`"


def _default(flag: Flag, linked: list[str]) -> str:
    if flag.required:
        return "required"
    machine = [_MACHINE_DEFAULTS[name] for name in linked if name in _MACHINE_DEFAULTS]
    shown = f"`{machine[0]}`" if machine else _show(flag.default)
    if linked:
        shown += ", from " + ", ".join(f"`{name}`" for name in linked)
    return shown


def _flag_cell(flag: Flag) -> str:
    spelled = ", ".join(f"`{s}`" for s in flag.spellings)
    if flag.value:
        spelled += f" {flag.value}"
    return spelled + (" (repeatable)" if flag.repeatable else "")


def _env_default(var: envs.EnvVar) -> str:
    if var.name in _MACHINE_DEFAULTS:
        return f"`{_MACHINE_DEFAULTS[var.name]}`"
    return _show(var.default)


def render() -> str:
    links = env_links()
    lines = [
        "# Configuration",
        "",
        f"<!-- Generated by `{REGENERATE}`; edit the code, not this page. -->",
        "",
        "Every flag of the three deployed commands and every environment variable pdserve reads, as the",
        "code declares them. Flags come from each service's frozen config dataclass (one default, one",
        "place); environment variables are read in one module (pdserve/envs.py) and copied into the",
        "configs at start-up, so a flag whose default names a variable takes its default from it and",
        "the flag wins. How the pieces fit: [deployment](deployment.md).",
        "",
    ]
    for command in DOCUMENTED_COMMANDS:
        module_name, help_ = COMMANDS[command]
        lines += [f"## `pdserve {command}`", "", f"{help_[0].upper()}{help_[1:]} (`{module_name}`).", "",
                  "| flag | default | meaning |", "|---|---|---|"]
        for flag in flags(command):
            linked = links.get((command, flag.spellings[0]), [])
            lines.append(f"| {_cell(_flag_cell(flag))} | {_cell(_default(flag, linked))} "
                         f"| {_cell(flag.help)} |")
        lines.append("")
    lines += ["## Environment variables", "",
              "Declared in pdserve/envs.py; an empty value counts as unset.", "",
              "| variable | default | meaning | default of |", "|---|---|---|---|"]
    for var in envs.ALL:
        feeds = [f"`{c} {f}`" for (c, f), names in links.items() if var.name in names]
        lines.append(f"| `{var.name}` | {_cell(_env_default(var))} | {_cell(var.doc)} | {', '.join(feeds)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.docs.configuration",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help=f"compare with {PAGE.name} instead of printing; exit 1 if it differs")
    args = parser.parse_args(argv)
    page = render()
    if not args.check:
        sys.stdout.write(page)
        return 0
    if PAGE.exists() and PAGE.read_text() == page:
        return 0
    print(f"docs/configuration.md is out of date; regenerate it: {REGENERATE}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
