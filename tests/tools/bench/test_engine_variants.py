"""`pdserve bench engine --cpu-isa ... --onednn-baselines`: which systems run beside pdserve, with which
environment, and how the table reports them."""

from __future__ import annotations

import io
from contextlib import redirect_stdout

import pytest

from tools.bench.engine import print_table
from tools.bench.engine_variants import AVX2_ONLY, OneDnnLinearsSystem, compare, isa_env, parse_isas, variants


def test_the_first_variant_is_pdserve_and_the_baselines_run_its_kernels():
    extra = variants(parse_isas("avx2, AVX512"), onednn_baselines=True, dtype="bfloat16")
    assert [(v.name, v.isa, v.dtype) for v in extra] == [
        ("pdserve-avx512", "avx512", "bfloat16"), ("pdserve-onednn-bf16", "avx2", "bfloat16"),
        ("pdserve-onednn-fp32", "avx2", "float32")]
    assert extra[1].system is OneDnnLinearsSystem
    # In fp32 the linears are oneDNN's already: one baseline.
    assert [v.name for v in variants(["avx2"], True, "float32")] == ["pdserve-onednn-fp32"]
    assert variants([], False, "bfloat16") == []


def test_an_unknown_variant_fails_before_anything_starts():
    with pytest.raises(ValueError, match="avx1024"):
        parse_isas("avx2,avx1024")


def test_avx2_systems_keep_torch_to_avx2_too():
    assert isa_env("avx2") == {"PDSERVE_CPU_ISA": "avx2", **AVX2_ONLY}
    assert isa_env("avx512") == {"PDSERVE_CPU_ISA": "avx512"}


def test_the_table_sets_each_variant_beside_pdserve():
    main = {"decode_tokens_per_s": 400.0, "decode_ms_per_step": 40.0, "prefill_s": 0.1, "peak_rss_mib": None,
            "runs_decode_tokens_per_s": [400.0, 420.0]}
    other = {"decode_tokens_per_s": 200.0, "decode_ms_per_step": 80.0, "prefill_s": 0.2, "peak_rss_mib": None,
             "runs_decode_tokens_per_s": [200.0, 200.0]}
    other |= compare(main, other)
    assert other["step_over_pdserve"] == 2.0 and other["step_over_pdserve_median_of_paired_rounds"] == 2.05
    report = {"batch": 16, "prompt_len": 128, "new_tokens": 64, "threads": 2, "dtype": "bfloat16",
              "device": "cpu", "cpu_isa": "avx2", "pdserve": main, "pdserve-onednn-bf16": other,
              "variants": ["pdserve-onednn-bf16"]}
    out = io.StringIO()
    with redirect_stdout(out):
        print_table(report)
    table = out.getvalue()
    assert "pdserve runs the avx2 C++ CPU kernels" in table
    assert "pdserve-onednn-bf16 decode" in table
    assert "step / pdserve's 2.00x (median of paired rounds 2.05x)" in table
