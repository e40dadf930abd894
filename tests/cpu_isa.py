"""`cpu_isa`: runs a test once per C++ kernel variant this CPU executes (kernels.cpu_ext.executable_isas:
avx512 and avx2 on an AVX-512 machine, avx2 alone on a Zen 3), with PDSERVE_CPU_ISA set to it, so the
kernels and every engine the test starts run that variant's library.

A module opts in with `from tests.cpu_isa import cpu_isa` and `pytest.mark.usefixtures("cpu_isa")`.
A variant the CPU runs but whose library is missing fails the test: `make setup` builds them all.
"""

from __future__ import annotations

import pytest

from kernels import cpu_ext
from pdserve import envs


@pytest.fixture(params=[variant.name for variant in cpu_ext.executable_isas()])
def cpu_isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> cpu_ext.Isa:
    variant = cpu_ext.isa(request.param)
    monkeypatch.setenv(envs.CPU_ISA.name, variant.name)
    assert cpu_ext.active_isa() == variant
    assert cpu_ext.load(variant), cpu_ext.unavailable_reason(variant)
    return variant
