"""A tiny checkpoint shared by the gateway tests (written once per session, about 4 s)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tools.models.tiny_model import (
        write_tiny_model,  # the test side may import torch; the gateway may not
    )

    return write_tiny_model(tmp_path_factory.mktemp("gateway") / "tiny", preset="tiny", seed=0)
