"""scripts/test_gpu.sh's arguments, its dry run and its refusal on a machine without a GPU: fast,
installing nothing (a fake nvidia-smi on PATH stands for "no GPU" on any machine)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tools.gpu.plan import PART_NAMES, REPO, torch_pins

SCRIPT = REPO / "scripts" / "test_gpu.sh"


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env=env)


def test_help_lists_every_option_and_part():
    result = run("--help")
    assert result.returncode == 0
    for option in ("--dry-run", "--venv", "--python", "--parts", "--vllm-python"):
        assert option in result.stdout
    assert ",".join(PART_NAMES) in result.stdout


def test_dry_run_prints_the_plan_and_installs_nothing(tmp_path):
    venv = tmp_path / "venv-gpu"
    result = run("--dry-run", "--venv", str(venv), "--parts", "parity,tp")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("[test-gpu] plan (dry run: nothing installed or run)")
    assert f"venv: {venv} (created" in result.stdout
    assert f"1. pip install {' '.join(torch_pins())}" in result.stdout
    assert "mooncake-transfer-engine==" in result.stdout and "nixl-cu12==" in result.stdout
    assert result.stdout.count("[not selected]") == len(PART_NAMES) - 2
    assert not venv.exists()


def test_bad_arguments_exit_2_before_anything_runs():
    unknown = run("--frobnicate")
    assert unknown.returncode == 2 and "unknown argument: --frobnicate" in unknown.stderr
    bad_part = run("--dry-run", "--parts", "parity,nope")
    assert bad_part.returncode == 2 and "unknown part(s) nope" in bad_part.stderr


def test_without_a_gpu_it_says_so_and_installs_nothing(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    (fake / "nvidia-smi").chmod(0o755)
    venv = tmp_path / "venv-gpu"
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", VENV_GPU=str(venv))
    result = run(env=env)
    assert result.returncode == 3
    assert "[test-gpu] no NVIDIA GPU here" in result.stderr
    assert not Path(venv).exists()


def test_with_python_given_it_installs_nothing_and_refuses_one_without_torch(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: a fake GPU'\n")
    (fake / "nvidia-smi").chmod(0o755)
    venv = tmp_path / "venv-gpu"
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", VENV_GPU=str(venv))
    result = run("--python", "/bin/false", env=env)
    assert result.returncode == 2 and "--python /bin/false cannot import torch" in result.stderr
    assert not venv.exists()
