"""`pdserve generate` and `pdserve bench engine` run as commands on the tiny checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def pdserve(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, check=True)


def test_generate_streams_text(qwen3_ckpt):
    result = pdserve("generate", "--model-path", str(qwen3_ckpt), "--prompt", "Hello there",
                     "--chat", "--max-new-tokens", "8", "--ignore-eos", "--num-pages", "64")
    assert result.stdout.strip()
    assert "[finish: length]" in result.stderr


@pytest.mark.long
def test_bench_engine_json(qwen3_ckpt):
    result = pdserve("bench", "engine", "--model", str(qwen3_ckpt), "--batch", "2", "--prompt-len", "8",
                     "--new-tokens", "4", "--repeats", "1", "--threads", "1", "--json", timeout=300)
    report = json.loads(result.stdout)
    assert report["pdserve"]["decode_tokens_per_s"] > 0 and report["hf"]["decode_tokens_per_s"] > 0
    assert report["ratio"] > 0 and report["pdserve"]["peak_rss_mib"] > 0
    assert report["greedy_outputs_equal"] == "2/2"
    assert report["device"] == "cpu" and "seed_figure" not in report  # the seeds' figure is a GPU one
    # The floor a step cannot beat on this machine, and the step's ratio to it.
    floor = report["floor"]
    assert floor["weight_bytes"] > 0 and floor["kv_bytes"] > 0 and floor["read_gb_s"] > 0
    assert report["pdserve_step_over_floor"] > 0


@pytest.mark.long
def test_bench_engine_speculative_ratios(qwen3_ckpt):
    result = pdserve("bench", "engine", "--model", str(qwen3_ckpt), "--batch", "2", "--prompt-len", "16",
                     "--new-tokens", "8", "--repeats", "1", "--threads", "1", "--skip-hf", "--json",
                     "--speculative-algorithm", "NGRAM", "--workload", "repeat", timeout=300)
    report = json.loads(result.stdout)
    assert report["pdserve_spec"]["decode_tokens_per_s"] > 0 and report["spec_ratio"] > 0
    assert report["spec_greedy_outputs_equal"] == "2/2"


def test_bench_engine_peer_without_vllm_fails_clearly(qwen3_ckpt):
    # This test's own Python has no vLLM: the peer must fail with the import error, not hang.
    result = subprocess.run([sys.executable, "-m", "pdserve", "bench", "engine", "--model", str(qwen3_ckpt),
                             "--batch", "2", "--prompt-len", "8", "--new-tokens", "4", "--repeats", "1",
                             "--threads", "1", "--skip-hf", "--peer-python", sys.executable, "--json"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "vLLM peer failed" in result.stderr and "No module named 'vllm'" in result.stderr
