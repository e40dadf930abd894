"""kernels.cpu_ext's choice of kernel variant: PDSERVE_CPU_ISA, and what `auto` picks from the CPU."""

from __future__ import annotations

import pytest

from engine.models.layer_ops import CpuKernelLayerOps, TorchLayerOps
from kernels import cpu_ext
from pdserve import envs


def test_auto_takes_the_best_variant_the_cpu_runs(monkeypatch):
    monkeypatch.setenv(envs.CPU_ISA.name, "auto")
    best = cpu_ext.active_isa()
    assert cpu_ext.runs_here(best)
    assert all(not cpu_ext.runs_here(v) for v in cpu_ext.ISAS[:cpu_ext.ISAS.index(best)])
    monkeypatch.delenv(envs.CPU_ISA.name)
    assert cpu_ext.active_isa() == best


def test_the_variable_forces_a_variant_and_names_its_library(monkeypatch):
    for variant in cpu_ext.executable_isas():
        monkeypatch.setenv(envs.CPU_ISA.name, variant.name.upper())
        assert cpu_ext.active_isa() == variant
        assert cpu_ext.library_path().name.startswith(f"pdserve_cpu_{variant.name}-")
        assert cpu_ext.ops().name == f"pdserve_cpu_{variant.name}"
        assert variant.name in CpuKernelLayerOps().describe()
    assert TorchLayerOps().describe() == "torch ops"


def test_an_unknown_or_unrunnable_variant_is_refused(monkeypatch):
    monkeypatch.setenv(envs.CPU_ISA.name, "sse9")
    with pytest.raises(ValueError, match="sse9"):
        cpu_ext.active_isa()
    missing = cpu_ext.Isa("future", ("-mfuture",), ("a_flag_no_cpu_has",))
    assert not cpu_ext.load(missing)
    assert "a_flag_no_cpu_has" in (cpu_ext.unavailable_reason(missing) or "")


def test_each_variant_has_its_own_flags_and_key():
    avx2, avx512 = cpu_ext.isa("avx2"), cpu_ext.isa("avx512")
    assert "-mavx2" in avx2.flags and "-mfma" in avx2.flags
    assert not any(flag.startswith("-mavx512") or flag == "-march=native" for flag in avx2.flags)
    assert cpu_ext.build_key(avx2) != cpu_ext.build_key(avx512)
