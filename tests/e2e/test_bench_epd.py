"""`pdserve bench epd` runs end to end (tiny-vl, mooncake) and reports what it says it does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# A benchmark run end to end: `make test-all` (pytest --long); `make test` keeps its argument checks.
pytestmark = [pytest.mark.long, pytest.mark.e2e, pytest.mark.timeout(400)]
ROOT = Path(__file__).resolve().parents[2]


def test_bench_epd_reports_ttft_throughput_and_bytes():
    run = subprocess.run([sys.executable, "-m", "pdserve", "bench", "epd", "--requests", "3",
                          "--image-size", "64", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=360)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(result["ttft"]) == {"colocated", "epd", "epd_cached"}
    assert all(stats["median_ms"] > 0 for stats in result["ttft"].values())
    assert result["encoder_images_per_s"] > 0
    # a 64x64 image is 4 embedding rows of the tiny-vl hidden size (128, fp32): one 16-row page
    assert result["embedding_bytes_per_image"] == 16 * 128 * 4
    assert result["embedding_cache_hits"] == 3  # each image sent twice: encoded once
