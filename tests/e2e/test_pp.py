"""Pipeline-parallel workers as real processes: `launch-server --pp-size 2` (rank 0 is stage 0 and
serves gRPC; it starts the stage-1 rank itself), driven through the worker gRPC API.

PD between two workers of 2 stages: each prefill rank writes whole pages of its stage's layers into
the decode rank of the same index, and greedy output of concurrent requests (1 to 130 tokens,
prefill chunks of 64) equals a colocated worker without stages, on mooncake and nixl. A prefill
and a decode of different --pp-size are refused in the handshake (FAILED_PRECONDITION) naming
both values, and every page is free afterwards.
"""

from __future__ import annotations

import grpc
import pytest

from tests.e2e.cluster import Cluster, wait_until, worker_args
from tests.e2e.test_tp import NEW_TOKENS, prompts_of
from tests.e2e.worker_client import run_all

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

LENGTHS = [1, 17, 64, 130]
SMALL = ("--chunked-prefill-size", "64", "--num-pages", "64")
PP2 = (*SMALL, "--pp-size", "2")

_colocated: dict[str, list[list[int]]] = {}  # the pp-1 reference, made once per module


def colocated_pp1(cluster: Cluster, model, prompts) -> list[list[int]]:
    if "tokens" not in _colocated:
        worker = cluster.worker("colocated-pp1", model, "null", extra=SMALL)
        results = run_all(worker.address, prompts, max_new_tokens=NEW_TOKENS)
        assert all(r.code is None for r in results), [(r.code, r.details) for r in results]
        _colocated["tokens"] = [r.tokens for r in results]
        worker.kill()
    return _colocated["tokens"]


def pages_freed(*procs) -> None:
    for proc in procs:
        wait_until(lambda proc=proc: proc.metric("pdserve:kv_pages_used") == 0, 30,
                   f"{proc.name}'s pages to be free")


# nixl in `make test-all` (tests/conftest.py): staged PD over mooncake here and between nodes.
@pytest.mark.parametrize("backend", ["mooncake", pytest.param("nixl", marks=pytest.mark.long)])
def test_pd_pp2_to_pp2_matches_colocated_pp1(cluster: Cluster, tiny_model, backend):
    prompts = prompts_of(LENGTHS)
    expected = colocated_pp1(cluster, tiny_model, prompts)
    bootstrap = cluster.bootstrap()  # the registry takes the whole model's layout from a staged worker
    prefill, decode = cluster.start_many([
        ("prefill-pp2", worker_args(tiny_model, "prefill", backend=backend, bootstrap=bootstrap, extra=PP2)),
        ("decode-pp2", worker_args(tiny_model, "decode", backend=backend, bootstrap=bootstrap, extra=PP2)),
    ])
    got = run_all(decode.address, prompts, [prefill.address] * len(prompts), max_new_tokens=NEW_TOKENS)
    for length, result, want in zip(LENGTHS, got, expected, strict=True):
        assert result.code is None, f"prompt of {length} tokens failed: {result.code} {result.details}"
        assert result.tokens == want, f"prompt of {length} tokens: PD PP 2 -> 2 differs from colocated PP 1"
    # Each stage's rank wrote its own layers: 2 of the 4 in every page.
    total = prefill.metric("pdserve:kv_transfer_bytes_total")
    per_rank = [prefill.metric("pdserve:kv_transfer_rank_bytes", rank=str(rank)) for rank in (0, 1)]
    assert total > 0 and per_rank[0] == per_rank[1] == total / 2
    pages_freed(prefill, decode)


def test_different_pp_sizes_are_refused_naming_both(cluster: Cluster, tiny_model):
    prefill, decode = cluster.start_many([
        ("prefill-pp2", worker_args(tiny_model, "prefill", backend="mooncake", extra=PP2)),
        ("decode-pp1", worker_args(tiny_model, "decode", backend="mooncake", extra=SMALL)),
    ])
    [result] = run_all(decode.address, prompts_of([40]), [prefill.address], max_new_tokens=4)
    assert result.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "--pp-size 2 (prefill) vs --pp-size 1 (decode)" in result.details
    pages_freed(prefill, decode)
