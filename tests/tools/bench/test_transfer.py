"""`pdserve bench transfer` end to end on one backend, small: the figures that
docs/benchmarks-transfer-gateway-registry.md quotes (bandwidth, checksum cost, verify_grant time)
come out of a real run."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

# A benchmark run end to end: `make test-all` (pytest --long); `make test` keeps its argument checks.
pytestmark = [pytest.mark.long, pytest.mark.e2e]


# One one-sided and the two-sided backend: the latter refuses writes that lack the bench's grant.
@pytest.mark.parametrize("backend,module", [("mooncake", "mooncake"), ("ucx", "ucxx")])
def test_bench_transfer_reports_checksum_and_grant_costs(backend, module):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{backend} engine not installed")
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "transfer", "--backend", backend,
                          "--sizes-mib", "1", "--repeats", "1", "--checksum", "--json"],
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[3])
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout[out.stdout.index("{"):])["results"][0]
    assert result["error"] == ""
    size = result["sizes"][0]
    assert size["gbps"] > 0 and size["checked_gbps"] > 0
    assert size["sender_checksum_ms"] > 0 and size["receiver_checksum_ms"] > 0
    assert result["prompt"]["verify_grant_ms"] > 0 and result["prompt"]["checksum_ms"] > 0
    assert result["prompt"]["poison_ms"] > 0
