"""Mooncake's engine chooses its own listening ports under P2PHANDSHAKE (probe for a free port, bind it
later), so a worker starting beside others can lose a port it chose and fail `initialize`. The backend
then starts a fresh engine (libkv/transfer/mooncake.py, `_initialized_engine`). Each case runs the real
engine in a child process: engines are never started inside pytest itself."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mooncake") is None,
                                reason="mooncake engine not installed")

ROOT = Path(__file__).resolve().parents[3]

# The real engine class, except that its first `failures` initialize calls fail as a lost port does.
_SCRIPT = textwrap.dedent("""
    import json, logging, sys
    from libkv.layout import KVLayout
    from libkv.pool import KVPool
    from libkv.transfer.mooncake import MooncakeBackend

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    failures = int(sys.argv[1])
    backend = MooncakeBackend(host="127.0.0.1")
    real = backend._engine_cls

    class LosesItsPorts(real):
        calls = 0

        def initialize(self, *args):
            type(self).calls += 1
            return -1 if type(self).calls <= failures else super().initialize(*args)

    backend._engine_cls = LosesItsPorts
    pool = KVPool(KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, dtype="float32"),
                  num_pages=8)
    try:
        backend.register(pool)
    except RuntimeError as exc:
        print(json.dumps({"error": str(exc), "calls": LosesItsPorts.calls}))
        sys.exit(0)
    print(json.dumps({"session": json.loads(backend.endpoint().blob)["session"],
                      "calls": LosesItsPorts.calls}))
    backend.close()
""")


def _start(failures: int) -> tuple[dict, str]:
    import json

    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(failures)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_a_lost_port_at_start_is_retried_with_a_fresh_engine():
    started, log = _start(failures=2)
    assert started["calls"] == 3 and started["session"].startswith("127.0.0.1:")
    assert "attempt 1 of 4" in log and "attempt 2 of 4" in log


def test_an_engine_that_never_starts_is_an_error_naming_the_call():
    failed, _ = _start(failures=4)
    assert failed["calls"] == 4
    assert "TransferEngine.initialize('127.0.0.1', P2PHANDSHAKE" in failed["error"] \
        and "4 times" in failed["error"]
