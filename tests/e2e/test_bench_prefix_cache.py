"""Smoke run of `pdserve bench prefix-cache` on the tiny model: it finishes, prints the table and
writes the JSON; the cache-on runs compute fewer prefill tokens, decode reuse sends fewer KV bytes,
and greedy outputs are identical across the five runs. No timing assertions."""

from __future__ import annotations

import json

import pytest

from tests.e2e.test_bench_serving import pdserve

# A benchmark run end to end: `make test-all` (pytest --long); `make test` keeps its argument checks.
pytestmark = [pytest.mark.long, pytest.mark.e2e, pytest.mark.timeout(300)]


def test_bench_prefix_cache_runs_and_the_cache_saves_work(tiny_model, tmp_path):
    out = tmp_path / "out"
    done = pdserve("bench", "prefix-cache", "--model-path", str(tiny_model), "--dtype", "float32",
                   "--users", "2", "--turns", "3", "--system-len", "64", "--user-len", "16",
                   "--output-len", "8", "--num-pages", "256", "--output-dir", str(out),
                   "--log-dir", str(tmp_path / "logs"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "greedy outputs identical across all runs: yes" in done.stdout
    result = json.loads((out / "prefix_cache.json").read_text())
    rows = {row["run"]: row for row in result["rows"]}
    assert all(row["requests"] == 6 and row["failures"] == 0 for row in rows.values())
    for kind in ("colocated", "pd"):
        assert result["ratios"][f"{kind} prefill tokens computed on/off"] < 1
        assert 0 < result["ratios"][f"{kind} TTFT mean on/off"]
    assert result["ratios"]["pd transfer bytes with/without decode reuse"] < 1
    assert rows["pd, cache on (decode reuse)"]["kv_transfer_bytes_saved"] > 0
    assert rows["pd, prefill cache only"]["kv_transfer_bytes_saved"] == 0
