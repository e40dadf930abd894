"""`pdserve bench serving-vs-vllm --cpu-isa avx2`: both peers run as on a CPU without AVX-512, and the
option reaches every process the bench starts (pdserve's servers, its engine-step probe, vLLM)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from tools.bench.engine_variants import AVX2_ONLY
from tools.bench.serving import vs_peer


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    vs_peer.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_avx2_caps_pdserve_kernels_and_both_peers_libraries():
    args = parse("--cpu-isa", "avx2")
    pdserve, peer = vs_peer.pdserve_env(args.cpu_isa), vs_peer.peer_env(args.cpu_isa)
    assert pdserve == {"PDSERVE_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                       "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert {k: peer[k] for k in AVX2_ONLY} == AVX2_ONLY  # vLLM is capped alike, and gets no pdserve variable
    assert "PDSERVE_CPU_ISA" not in peer
    # vLLM picks its kernels from torch's CPU probes: its processes start with them answering "no AVX-512".
    assert peer["PYTHONPATH"].split(os.pathsep)[0] == str(vs_peer.PEER_WITHOUT_AVX512)


def test_the_peer_sees_a_cpu_without_avx512_or_amx(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PYTHONPATH", "elsewhere")
    env = {**os.environ, **vs_peer.peer_env("avx2")}
    probes = subprocess.run([sys.executable, "-c", "import torch; print(torch.cpu._is_avx512_supported(), "
                             "torch.cpu._is_avx512_bf16_supported(), torch.cpu._is_amx_tile_supported())"],
                            env=env, capture_output=True, text=True, check=True)
    assert probes.stdout.split() == ["False", "False", "False"]
    assert env["PYTHONPATH"].endswith(os.pathsep + "elsewhere")  # the caller's path is kept


def test_without_the_option_nothing_is_capped():
    args = parse()
    assert args.cpu_isa is None
    assert vs_peer.pdserve_env(args.cpu_isa) == {} and vs_peer.peer_env(args.cpu_isa) == {}


def test_an_isa_it_cannot_emulate_is_refused():
    with pytest.raises(SystemExit):
        parse("--cpu-isa", "avx512")


def test_the_engine_step_probe_runs_capped(monkeypatch: pytest.MonkeyPatch, tmp_path):
    seen = {}

    class Done:
        stdout, stderr = "decode step median 12.50 ms", ""

    def run(command, **kwargs):
        seen.update(kwargs["env"])
        return Done()

    monkeypatch.setattr(vs_peer.subprocess, "run", run)
    args = parse("--cpu-isa", "avx2", "--model-path", str(tmp_path))
    assert vs_peer.engine_step_ms(args, 2, [0, 1]) == 12.5
    assert seen["PDSERVE_CPU_ISA"] == "avx2" and seen["ONEDNN_MAX_CPU_ISA"] == "AVX2"
