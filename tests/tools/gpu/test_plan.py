"""tools/gpu/plan.py: the GPU venv gets pyproject's pins, with torch first and Mooncake's CUDA build."""

from __future__ import annotations

import pytest

from tools.gpu.plan import (
    PART_NAMES,
    _pyproject,
    base_requirements,
    check_parts,
    cuda_wheels,
    describe,
    torch_pins,
)


def _pyproject_deps() -> tuple[list[str], list[str]]:
    project = _pyproject()["project"]
    return project["dependencies"], project["optional-dependencies"]["dev"]


def test_every_pin_is_installed_once_torch_and_triton_first_mooncake_swapped():
    deps, dev = _pyproject_deps()
    first, rest = torch_pins(), base_requirements()
    assert first == [d for d in deps if d.startswith(("torch==", "triton=="))] and len(first) == 2
    mooncake = next(d for d in deps if d.startswith("mooncake-transfer-engine-non-cuda=="))
    assert sorted(first + rest + [mooncake]) == sorted(deps + dev)
    version = mooncake.split("==")[1]
    assert cuda_wheels(12) == [f"mooncake-transfer-engine=={version}", "nixl==1.5.1", "nixl-cu12==1.5.1"]
    assert cuda_wheels(13)[0] == "mooncake-transfer-engine-cuda13"
    assert cuda_wheels(13)[2] == "nixl-cu13==1.5.1"
    assert cuda_wheels(None) == [] and cuda_wheels(11) == []


def test_parts_are_checked_and_described():
    assert check_parts("pd,tp") == ["pd", "tp"]
    with pytest.raises(SystemExit, match="unknown part"):
        check_parts("pd,gpu")
    text = describe(".venv-gpu-test-none", ["bench"])
    assert "venv: .venv-gpu-test-none (created" in text
    assert all(f"  {name}" in text for name in PART_NAMES)
    assert text.count("[not selected]") == len(PART_NAMES) - 1
