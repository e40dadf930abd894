"""docs/configuration.md is what `python -m tools.docs.configuration` prints, so it cannot drift from the
flags and environment variables the code declares."""

from __future__ import annotations

import difflib
import os

from pdserve import envs
from tools.docs import configuration


def test_committed_page_matches_the_generator():
    expected = configuration.render()
    committed = configuration.PAGE.read_text() if configuration.PAGE.exists() else ""
    if committed != expected:
        lines = difflib.unified_diff(committed.splitlines(), expected.splitlines(),
                                     "docs/configuration.md (committed)", "generator", lineterm="")
        diff = "\n".join(list(lines)[:40])
        raise AssertionError(f"docs/configuration.md is out of date; regenerate it with\n"
                             f"    {configuration.REGENERATE}\n{diff}")


def test_every_flag_and_variable_is_on_the_page():
    page = configuration.render()
    for command in configuration.DOCUMENTED_COMMANDS:
        assert f"## `pdserve {command}`" in page
        for flag in configuration.flags(command):
            assert f"`{flag.spellings[0]}`" in page, flag
    for var in envs.ALL:
        assert f"| `{var.name}` |" in page


def test_page_does_not_depend_on_the_environment(monkeypatch):
    for var in envs.ALL:
        monkeypatch.setenv(var.name, configuration._probe_value(var))
    assert configuration.render() == configuration.PAGE.read_text()
    # and the caller's environment is left as it was
    assert all(os.environ[var.name] == configuration._probe_value(var) for var in envs.ALL)


def test_flag_defaults_read_from_a_variable_name_it():
    links = configuration.env_links()
    assert links[("launch-server", "--waiting-timeout")] == [envs.WAITING_TIMEOUT.name]
    assert links[("bootstrap", "--heartbeat-interval")] == [envs.HEARTBEAT_INTERVAL.name]
    assert ("launch-server", "--page-size") not in links


def test_check_mode_names_the_command_that_regenerates(tmp_path, monkeypatch, capsys):
    assert configuration.main(["--check"]) == 0
    stale = tmp_path / "configuration.md"
    stale.write_text("# Configuration\n")
    monkeypatch.setattr(configuration, "PAGE", stale)
    assert configuration.main(["--check"]) == 1
    assert configuration.REGENERATE in capsys.readouterr().err
