"""setup_logging's line format and level; the gateway-facing modules stay torch-free."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]

LOG_SCRIPT = """
import logging
from services.common.logging import setup_logging
log = setup_logging("demo")
setup_logging("demo")  # twice: still one handler
log.info("hello %s", "room-1")
log.warning("careful")
"""


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, **env})


def test_log_line_format_and_level() -> None:
    result = run_python(LOG_SCRIPT, PDSERVE_LOG_LEVEL="INFO")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2
    assert re.fullmatch(r"\[\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\] hello room-1", lines[0])
    assert lines[1].endswith("] careful")
    quiet = run_python(LOG_SCRIPT, PDSERVE_LOG_LEVEL="warning")
    assert [line.split("] ", 1)[1] for line in quiet.stdout.splitlines()] == ["careful"]
    bad = run_python(LOG_SCRIPT, PDSERVE_LOG_LEVEL="LOUD")
    assert bad.returncode != 0 and "PDSERVE_LOG_LEVEL='LOUD' is not a log level" in bad.stderr


def test_registry_client_and_server_plumbing_do_not_import_torch() -> None:
    # The gateway must not import torch; it uses these modules.
    result = run_python(
        "import sys\n"
        "import services.common.registry_client, services.bootstrap.main, services.common.grpc_server\n"
        "import services.common.metrics, services.common.logging, pdserve.config_flags\n"
        "import protos.v1.worker_pb2_grpc\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n")
    assert result.returncode == 0, result.stderr
