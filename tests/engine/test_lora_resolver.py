"""On-demand adapter names (engine.lora.resolver): a client-given name resolves only to a folder
directly inside the resolver directory; anything that could reach elsewhere is not found."""

from __future__ import annotations

import os

import pytest

from engine.lora.resolver import AdapterNotFound, resolve_adapter_folder


@pytest.fixture
def root(tmp_path):
    adapters = tmp_path / "adapters"
    for name in ("good", "v1.2_x-y"):
        (adapters / name).mkdir(parents=True)
        (adapters / name / "adapter_config.json").write_text("{}")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "adapter_config.json").write_text("{}")
    os.symlink(tmp_path / "outside", adapters / "escape")  # a link out of the directory
    (adapters / "empty").mkdir()
    return adapters


def test_a_name_resolves_to_its_folder(root):
    assert resolve_adapter_folder(root, "good") == (root / "good").resolve()
    assert resolve_adapter_folder(str(root), "v1.2_x-y") == (root / "v1.2_x-y").resolve()


@pytest.mark.parametrize("name", ["", ".", "..", "../outside", "good/..", "good/../good", "a/b", "/etc",
                                  ".hidden", "x..y", "good\\x", "good\x00", "-flag", "n" * 129, "é"])
def test_names_that_are_not_one_plain_component_are_refused(root, name):
    with pytest.raises(AdapterNotFound, match="is not an adapter name"):
        resolve_adapter_folder(root, name)


def test_links_out_of_the_directory_and_missing_adapters_are_not_found(root):
    with pytest.raises(AdapterNotFound, match="resolves outside the adapter directory"):
        resolve_adapter_folder(root, "escape")
    with pytest.raises(AdapterNotFound, match="no adapter 'empty'"):
        resolve_adapter_folder(root, "empty")
    with pytest.raises(AdapterNotFound, match="no adapter 'absent'"):
        resolve_adapter_folder(root, "absent")
