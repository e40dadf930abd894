"""The gateway never imports torch (nor transformers, engine or libkv), checked in a fresh interpreter.

It hashes prompt pages exactly as the workers do, with the same function: pdserve.page_hash
(standard library only). tests/test_layering.py checks the same rule statically."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_gateway_app_does_not_import_torch(tiny_model: Path) -> None:
    code = (
        "import sys\n"
        "import services.gateway.main, services.gateway.app, tools.bench.gateway, tools.up\n"
        "from services.gateway.config import GatewayConfig\n"
        "from services.gateway.app import create_app\n"
        "from services.gateway.state import build_state\n"
        f"create_app(build_state(GatewayConfig(model_path={str(tiny_model)!r})))\n"
        "loaded = sorted(m for m in sys.modules\n"
        "                if m.split('.')[0] in ('torch', 'transformers', 'engine', 'libkv'))\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
