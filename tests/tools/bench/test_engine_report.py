"""`pdserve bench engine`'s table: a CUDA run is set beside the seeds' Qwen3-4B figure, a CPU run is not."""

from __future__ import annotations

import io
from contextlib import redirect_stdout

from tools.bench.engine import SEED_FIGURE, print_table


def _report(device: str) -> dict:
    report = {"batch": 1, "prompt_len": 128, "new_tokens": 64, "threads": 2, "dtype": "bfloat16",
              "device": device, "pdserve": {"decode_tokens_per_s": 72.0, "decode_ms_per_step": 13.9,
                                            "prefill_s": 0.05, "peak_rss_mib": None}}
    if device.startswith("cuda"):
        report["seed_figure"] = SEED_FIGURE
    return report


def _table(report: dict) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        print_table(report)
    return out.getvalue()


def test_cuda_run_prints_the_seed_figure_and_the_ratio():
    table = _table(_report("cuda"))
    assert "bfloat16, cuda" in table
    assert ("seeds    decode    144.0 tok/s (SGLang, Qwen3-4B, batch 1, CUDA graphs; "
            "pdserve / seeds: 0.50x)") in table


def test_cpu_run_has_no_seed_line():
    assert "seeds" not in _table(_report("cpu"))
