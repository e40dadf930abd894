"""Tensor-parallel workers as real processes: `launch-server --tp-size 2` (rank 0 serves gRPC and
starts rank 1 itself), driven through the worker gRPC API.

Greedy output of concurrent requests (1 to 300 tokens, prefill chunks of 64) equals HF
transformers' on the Qwen3 tiny preset and on the tiny-kv4 Llama (4 KV heads). Killing a follower
rank takes the whole worker down (it exits non-zero, it does not hang), and killing the worker
leaves no rank behind. A --tp-size that does not divide the KV heads is refused at start.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch

from tests.e2e.cluster import Cluster, wait_until, worker_args
from tests.e2e.hf import hf_greedy
from tests.e2e.matrix import cover
from tests.e2e.worker_client import run_all
from tools.models.tiny_model import write_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

LENGTHS = [1, 5, 17, 64, 130, 300]
NEW_TOKENS = 12
CHUNK = ("--chunked-prefill-size", "64", "--num-pages", "256")
LOGPROB_TOLERANCE = 1e-3


@pytest.fixture(scope="session")
def kv4_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("e2e-model") / "kv4", preset="tiny-kv4", seed=2,
                            arch="llama")


def prompts_of(lengths: list[int], seed: int = 13) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 4000, (n,), generator=generator).tolist() for n in lengths]


def followers_of(pid: int) -> list[int]:
    """Child processes of `pid` that are TP follower ranks."""
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "engine.tp.follower" in line]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout
    return bool(state.strip()) and not state.strip().startswith("Z")


# The 4-KV-head model in `make test` (the tiny one runs TP 2 in the PD tests below); both in test-all.
@pytest.mark.parametrize("model_name", [pytest.param("tiny_model", marks=pytest.mark.long), "kv4_model"])
def test_colocated_tp2_matches_hf(cluster: Cluster, model_name, request):
    model = request.getfixturevalue(model_name)
    prompts = prompts_of(LENGTHS)
    worker = cluster.worker("colocated-tp2", model, "null", extra=(*CHUNK, "--tp-size", "2"))
    assert len(followers_of(worker.pid)) == 1
    got = run_all(worker.address, prompts, max_new_tokens=NEW_TOKENS)
    expected = hf_greedy(model, prompts, NEW_TOKENS)
    for length, result, hf_tokens in zip(LENGTHS, got, expected, strict=True):
        assert result.code is None, f"prompt of {length} tokens failed: {result.code} {result.details}"
        assert result.tokens == hf_tokens, f"prompt of {length} tokens: TP 2 differs from HF transformers"
    wait_until(lambda: worker.metric("pdserve:kv_pages_used") == 0, 30, "KV pages to be free")


def test_dead_rank_takes_the_worker_down(cluster: Cluster, tiny_model):
    worker = cluster.worker("colocated-tp2", tiny_model, "null", extra=(*CHUNK, "--tp-size", "2"))
    [follower] = followers_of(worker.pid)
    os.kill(follower, signal.SIGKILL)
    wait_until(lambda: not worker.alive(), 30, "the worker to exit after its rank 1 died")
    assert worker.popen.returncode == 1
    assert "tp rank 1 exited with code -9 (of 2 ranks); exiting" in worker.log()


def test_frozen_rank_takes_the_worker_down(cluster: Cluster, tiny_model):
    """A rank that stops (alive to the OS, silent to the group) must not hold the worker's requests
    in a collective until --dist-timeout: its heartbeat stops and the worker exits."""
    worker = cluster.worker("colocated-tp2", tiny_model, "null", extra=(*CHUNK, "--tp-size", "2"))
    [follower] = followers_of(worker.pid)
    os.kill(follower, signal.SIGSTOP)
    try:
        wait_until(lambda: not worker.alive(), 60, "the worker to exit after its rank 1 froze")
    finally:
        if alive(follower):
            os.kill(follower, signal.SIGKILL)
    assert worker.popen.returncode == 1
    assert "tp rank 1 sent no heartbeat for 15s (of 2 ranks); exiting" in worker.log()


def test_killed_worker_leaves_no_rank_behind(cluster: Cluster, tiny_model):
    worker = cluster.worker("colocated-tp2", tiny_model, "null", extra=(*CHUNK, "--tp-size", "2"))
    [follower] = followers_of(worker.pid)
    worker.kill(signal.SIGKILL)
    deadline = time.monotonic() + 30
    while alive(follower) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(follower), "rank 1 outlived its worker"


def test_tp_size_that_splits_kv_heads_is_refused(tiny_model):
    proc = subprocess.run([sys.executable, "-m", "pdserve", "launch-server", "--model-path", str(tiny_model),
                           "--port", "0", "--tp-size", "4"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--tp-size 4: tp size 4 does not divide the model's 2 KV heads" in proc.stdout + proc.stderr


# Each model and each backend once in `make test`, every pair in `make test-all` (tests/e2e/matrix.py).
@pytest.mark.parametrize(("model_name", "backend"), cover(["tiny_model", "kv4_model"], ["mooncake", "nixl"]))
def test_pd_tp2_to_tp2_matches_hf(cluster: Cluster, model_name, backend, request):
    model = request.getfixturevalue(model_name)
    prompts = prompts_of(LENGTHS)
    tp2 = (*CHUNK, "--tp-size", "2")
    bootstrap = cluster.bootstrap()
    prefill, decode = cluster.start_many([
        ("prefill-tp2", worker_args(model, "prefill", backend=backend, bootstrap=bootstrap, extra=tp2)),
        ("decode-tp2", worker_args(model, "decode", backend=backend, bootstrap=bootstrap, extra=tp2)),
    ])
    got = run_all(decode.address, prompts, [prefill.address] * len(prompts), max_new_tokens=NEW_TOKENS)
    expected = hf_greedy(model, prompts, NEW_TOKENS)
    for length, result, hf_tokens in zip(LENGTHS, got, expected, strict=True):
        assert result.code is None, f"prompt of {length} tokens failed: {result.code} {result.details}"
        assert result.tokens == hf_tokens, \
            f"prompt of {length} tokens: PD TP 2 -> 2 differs from HF transformers"
    total = prefill.metric("pdserve:kv_transfer_bytes_total")
    per_rank = [prefill.metric("pdserve:kv_transfer_rank_bytes", rank=str(rank)) for rank in (0, 1)]
    assert per_rank[0] == per_rank[1] == total / 2
    for proc in (prefill, decode):
        wait_until(lambda proc=proc: proc.metric("pdserve:kv_pages_used") == 0, 30,
                   f"{proc.name}'s pages to be free")
    prefill.kill(signal.SIGTERM)  # a graceful stop logs each rank's share of the bytes
    match = re.search(r"KV bytes written per tp rank: rank 0 (\d+), rank 1 (\d+)", prefill.log())
    assert match, prefill.log()[-3000:]
    rank0, rank1 = int(match[1]), int(match[2])
    assert rank0 == rank1 > 0 and rank0 + rank1 == total  # each rank wrote its own half of every page


# Each model, backend and direction once in `make test`, the whole product in `make test-all`.
@pytest.mark.parametrize(("model_name", "backend", "sizes"),
                         cover(["tiny_model", "kv4_model"], ["mooncake", "nixl"], ["1-2", "2-1"]))
def test_pd_between_tp_sizes_matches_hf(cluster: Cluster, model_name, backend, sizes, request):
    # Each prefill rank writes to each decode rank only the KV heads both hold (byte pieces of pages);
    # checksums over max(sizes) head parts let decode check every page without gathering it.
    prefill_tp, decode_tp = (int(size) for size in sizes.split("-"))
    model = request.getfixturevalue(model_name)
    prompts = prompts_of(LENGTHS)
    bootstrap = cluster.bootstrap()  # the registry takes workers of one model with different TP sizes
    prefill, decode = cluster.start_many([
        ("prefill", worker_args(model, "prefill", backend=backend, bootstrap=bootstrap,
                                extra=(*CHUNK, "--tp-size", str(prefill_tp)))),
        ("decode", worker_args(model, "decode", backend=backend, bootstrap=bootstrap,
                               extra=(*CHUNK, "--tp-size", str(decode_tp)))),
    ])
    got = run_all(decode.address, prompts, [prefill.address] * len(prompts), max_new_tokens=NEW_TOKENS)
    expected = hf_greedy(model, prompts, NEW_TOKENS)
    for length, result, hf_tokens in zip(LENGTHS, got, expected, strict=True):
        assert result.code is None, f"prompt of {length} tokens failed: {result.code} {result.details}"
        assert result.tokens == hf_tokens, \
            f"prompt of {length} tokens: PD {prefill_tp} -> {decode_tp} differs from HF"
    for proc in (prefill, decode):
        wait_until(lambda proc=proc: proc.metric("pdserve:kv_pages_used") == 0, 30,
                   f"{proc.name}'s pages to be free")


def test_unmappable_tp_sizes_are_refused_naming_both(cluster: Cluster, kv4_model):
    # 4 KV heads: 2 and 4 map, but ucx moves whole pages only, so 1 -> 2 over ucx is refused on both
    # sides (prefill answers FAILED_PRECONDITION, decode passes it on), naming both sizes.
    prefill, decode = cluster.start_many([
        ("prefill", worker_args(kv4_model, "prefill", backend="ucx", extra=(*CHUNK, "--tp-size", "1"))),
        ("decode", worker_args(kv4_model, "decode", backend="ucx", extra=(*CHUNK, "--tp-size", "2"))),
    ])
    [result] = run_all(decode.address, prompts_of([40]), [prefill.address], max_new_tokens=4)
    assert result.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "KV between --tp-size 1 and --tp-size 2 needs mooncake or nixl" in result.details
    for proc in (prefill, decode):
        wait_until(lambda proc=proc: proc.metric("pdserve:kv_pages_used") == 0, 30,
                   f"{proc.name}'s pages to be free")
