"""`pdserve bench prefix-cache --case store` on the tiny model: both runs (without and with Mooncake
Store) happen, every request is answered, the with-store run's prefill workers fetched pages from
the store and so computed fewer prompt tokens, the run without the store touched no store, and greedy
outputs are identical (fp32). The printed table matches the JSON. No timing assertions."""

from __future__ import annotations

import json
import re

import pytest

from tests.e2e.test_bench_serving import pdserve
from tools.bench.serving.mooncake_master import binary

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300),
              pytest.mark.skipif(binary() is None,
                                 reason="mooncake_master (the Mooncake wheel) is not installed")]

USERS, TURNS = 2, 4


@pytest.mark.long
def test_bench_store_case_runs_both_and_the_store_serves_pages(tiny_model, tmp_path):
    out = tmp_path / "out"
    done = pdserve("bench", "prefix-cache", "--case", "store", "--model-path", str(tiny_model),
                   "--dtype", "float32", "--users", str(USERS), "--turns", str(TURNS), "--system-len", "32",
                   "--user-len", "16", "--output-len", "16", "--num-pages", "256", "--store-segment-mb", "16",
                   "--output-dir", str(out), "--log-dir", str(tmp_path / "logs"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "greedy outputs identical with and without the store: yes" in done.stdout
    result = json.loads((out / "prefix_cache_store.json").read_text())
    without, with_store = result["rows"]
    assert (without["store"], with_store["store"]) == (False, True)
    for row in (without, with_store):
        assert row["requests"] == USERS * TURNS and row["failures"] == 0
        assert 0 < row["prefill_tokens_computed"] <= row["prompt_tokens"]
    assert without["prompt_tokens"] == with_store["prompt_tokens"]
    assert (without["store_hit_pages"] == 0 and without["store_written_pages"] == 0
            and without["store_errors"] == 0)
    assert with_store["store_hit_pages"] > 0 and with_store["store_written_pages"] > 0
    assert with_store["prefill_tokens_computed"] < without["prefill_tokens_computed"]
    ratio = result["ratios"]["prefill tokens computed with/without store"]
    assert ratio == pytest.approx(with_store["prefill_tokens_computed"] / without["prefill_tokens_computed"])
    printed = re.search(r"prefill tokens computed with/without store\s+([\d.]+)", done.stdout)
    assert printed and float(printed.group(1)) == pytest.approx(ratio, abs=1e-3)
    assert result["ratios"]["TTFT mean with/without store"] > 0


def test_bad_store_case_flags_are_clear_errors(tiny_model, tmp_path):
    done = pdserve("bench", "prefix-cache", "--case", "store", "--model-path", str(tiny_model),
                   "--store-segment-mb", "0", "--output-dir", str(tmp_path / "out"))
    assert done.returncode == 2
    assert "--store-segment-mb must be positive and --think-ms at least 0" in done.stderr
    assert not (tmp_path / "out").exists()
