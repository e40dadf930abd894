"""The built-in checkpoint the tool commands run on (written once per session, on local disk)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.models.tiny_model import write_tiny_model


@pytest.fixture(scope="session")
def qwen3_ckpt(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("ckpt") / "qwen3", preset="tiny", seed=0)
