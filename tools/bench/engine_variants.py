"""`pdserve bench engine --cpu-isa avx2,avx512 --onednn-baselines`: the same engine on other C++ kernel
variants (kernels.cpu_ext: one library per instruction set, PDSERVE_CPU_ISA picks one) and on oneDNN's
linears, in the same run as the main pdserve system, each in its own child process, rounds alternating.

The first `--cpu-isa` variant is the one the main `pdserve` system runs; every other one becomes a system
`pdserve-<isa>`. The baselines run the first variant's kernels with the linears on oneDNN: in the
benchmarked dtype with the C++ bf16 GEMM switched off (`pdserve-onednn-bf16`), and in fp32
(`pdserve-onednn-fp32`: fp32 linears are always oneDNN's). On an AVX-512 machine `--cpu-isa avx2` so
stands for a CPU without AVX-512 (the avx2 library holds no AVX-512 instruction), and the ratios say
what each choice costs there. So that the rest of torch runs as it would there too, a system on the avx2
kernels also caps torch's own vector code, oneDNN and MKL at AVX2 (AVX2_ONLY below): without that its
oneDNN bf16 baseline would use AVX512-BF16 or AMX, which such a CPU does not have.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from tools.bench.engine_systems import PdserveSystem


class OneDnnLinearsSystem(PdserveSystem):
    """pdserve with its bf16 linears on oneDNN (the C++ GEMM off in this child process only)."""

    def __init__(self, *args) -> None:
        from kernels import cpu_kernels

        cpu_kernels.bf16_gemm_preferred = lambda: False  # read once per Linear at load
        super().__init__(*args)


# Environment that keeps torch's libraries to AVX2 in a child process (read when each starts).
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def isa_env(isa: str) -> dict[str, str]:
    from pdserve import envs

    return {envs.CPU_ISA.name: isa, **(AVX2_ONLY if isa == "avx2" else {})}


@dataclass(frozen=True)
class Variant:
    name: str  # the report's key
    isa: str  # PDSERVE_CPU_ISA of its child process
    dtype: str
    system: type[PdserveSystem] = PdserveSystem


def parse_isas(text: str | None) -> list[str]:
    from kernels import cpu_ext

    names = [name.strip().lower() for name in (text or "").split(",") if name.strip()]
    for name in names:
        if name != "auto":
            cpu_ext.isa(name)  # an unknown name fails here, before any engine starts
    return names


def variants(isas: list[str], onednn_baselines: bool, dtype: str) -> list[Variant]:
    """The systems beside the main one (which runs isas[0], or auto)."""
    first = isas[0] if isas else "auto"
    out = [Variant(f"pdserve-{isa}", isa, dtype) for isa in isas[1:]]
    if onednn_baselines:
        if dtype == "bfloat16":
            out.append(Variant("pdserve-onednn-bf16", first, dtype, OneDnnLinearsSystem))
        out.append(Variant("pdserve-onednn-fp32", first, "float32"))
    return out


def compare(main: dict, other: dict) -> dict:
    """The other system's step time over the main one's (above 1: the main one is faster), as the
    ratio of medians and as the median of per-round ratios (rounds alternate, so round i of each ran
    under about the same load on a shared machine)."""
    paired = [a / b for a, b in zip(main["runs_decode_tokens_per_s"], other["runs_decode_tokens_per_s"],
                                    strict=True)]
    return {"step_over_pdserve": other["decode_ms_per_step"] / main["decode_ms_per_step"],
            "step_over_pdserve_median_of_paired_rounds": statistics.median(paired)}
