"""Workers with DP attention (`--tp-size 2 --dp-size 2 --enable-dp-attention`), as real processes, on
the tiny DeepSeek (MLA + routed experts): greedy output of concurrent requests equals HF
transformers colocated and in PD (DP groups on both sides on mooncake and nixl, and DP groups
against a plain worker either way), with prefix-cache hits, both groups taking requests, and every
page free afterwards, also after clients cut off at every stage of their requests."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.e2e.cluster import Cluster, wait_until, worker_args
from tests.e2e.hf import hf_greedy
from tests.e2e.test_moe_mla_pd import LENGTHS, NEW_TOKENS, assert_matches, prompts_of
from tests.e2e.worker_client import run_all
from tools.models.tiny_model import write_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

DP2 = ("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--chunked-prefill-size", "64",
       "--num-pages", "128")
DP2_EP2 = (*DP2, "--ep", "2")
TP1 = ("--chunked-prefill-size", "64", "--num-pages", "128")
TP2 = (*TP1, "--tp-size", "2")


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("e2e-model") / "deepseek", preset="tiny-deepseek", seed=3)


def test_colocated_dp_attention_matches_hf(cluster: Cluster, deepseek):
    worker = cluster.worker("colocated-dp2", deepseek, "null", extra=DP2)
    prompts = prompts_of(LENGTHS, seed=51)
    got = run_all(worker.address, prompts, max_new_tokens=NEW_TOKENS)
    assert_matches(got, hf_greedy(deepseek, prompts, NEW_TOKENS), "colocated TP 2 in 2 DP attention groups")
    assert worker.metric("pdserve:moe_expert_tokens_total") > 0
    wait_until(lambda: worker.metric("pdserve:kv_pages_used") == 0, 30, "the worker's pages to be free")


# (prefill, decode) layouts: DP groups on both sides, and DP groups against a plain worker. `make test`
# runs three (DP groups with experts on both sides, and each direction against a plain worker, both
# backends); `make test-all` all five.
PD_LAYOUTS = [
    pytest.param(DP2, DP2, "mooncake", id="dp2-dp2-mooncake", marks=pytest.mark.long),
    pytest.param(DP2_EP2, DP2_EP2, "nixl", id="dp2ep2-dp2ep2-nixl"),
    pytest.param(DP2, TP1, "mooncake", id="dp2-tp1-mooncake"),
    pytest.param(TP1, DP2, "nixl", id="tp1-dp2-nixl"),
    pytest.param(TP2, DP2_EP2, "mooncake", id="tp2-dp2ep2-mooncake", marks=pytest.mark.long),
]


@pytest.mark.parametrize(("prefill_layout", "decode_layout", "backend"), PD_LAYOUTS)
def test_pd_dp_attention_matches_hf(cluster: Cluster, deepseek, prefill_layout, decode_layout, backend):
    """Each prefill group writes its rooms' latent pages straight into the decode group that
    reserved them; a second round extending the first hits the prefix caches of the groups."""
    bootstrap = cluster.bootstrap()
    prefill, decode = cluster.start_many([
        ("prefill", worker_args(deepseek, "prefill", backend=backend, bootstrap=bootstrap,
                                extra=prefill_layout)),
        ("decode", worker_args(deepseek, "decode", backend=backend, bootstrap=bootstrap,
                               extra=decode_layout)),
    ])
    first = prompts_of(LENGTHS, seed=52)
    second = [p + q for p, q in zip(first[2:], prompts_of([20] * 4, seed=53), strict=True)]
    expected = hf_greedy(deepseek, first + second, NEW_TOKENS)
    for prompts, want, what in ((first, expected[:len(first)], "cold"),
                                (second, expected[len(first):], "prefix hits")):
        got = run_all(decode.address, prompts, [prefill.address] * len(prompts), max_new_tokens=NEW_TOKENS)
        assert_matches(got, want, f"{backend} PD {what}")
    if prefill_layout in (DP2, DP2_EP2):  # both prefill groups computed prompts and wrote their pages
        for rank in ("0", "1"):
            assert prefill.metric("pdserve:kv_transfer_rank_bytes", rank=rank) > 0
    for proc, layout in ((prefill, prefill_layout), (decode, decode_layout)):
        if layout in (DP2, DP2_EP2):  # both groups took requests (decode: reserved their pages)
            for group in ("0", "1"):
                assert proc.metric("pdserve:dp_rank_requests_total", dp_rank=group) > 0, proc.name
    for proc in (prefill, decode):
        wait_until(lambda proc=proc: proc.metric("pdserve:kv_pages_used") == 0, 30,
                   f"{proc.name}'s pages to be free")


def test_clients_leaving_at_any_stage_leave_no_page_held_on_any_group(cluster: Cluster, deepseek):
    """Deadlines from 0.2 s to 4 s cut requests off while their pages are reserved on a decode group,
    while a prefill group computes and writes them, and while decoding; then every group of both
    workers is back to zero pages and the pair still serves exactly."""
    slow = ("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--chunked-prefill-size", "16",
            "--num-pages", "512")
    prefill, decode = cluster.start_many([
        ("prefill", worker_args(deepseek, "prefill", backend="mooncake", extra=slow)),
        ("decode", worker_args(deepseek, "decode", backend="mooncake", extra=slow)),
    ])
    prompts = prompts_of([400] * 8, seed=54)
    with ThreadPoolExecutor(8) as pool:
        cut = list(pool.map(lambda pair: run_all(decode.address, [pair[1]], [prefill.address],
                                                 max_new_tokens=64, timeout_s=pair[0])[0],
                            zip([0.2, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0], prompts, strict=True)))
    assert any(r.code == grpc.StatusCode.DEADLINE_EXCEEDED for r in cut), [r.code for r in cut]
    for proc in (prefill, decode):
        for group in ("0", "1"):
            wait_until(lambda proc=proc, group=group:
                       proc.metric("pdserve:dp_rank_kv_pages_used", dp_rank=group) == 0,
                       60, f"{proc.name}'s group {group} pages to be free")
    again = prompts_of([30, 90], seed=55)
    got = run_all(decode.address, again, [prefill.address] * 2, max_new_tokens=NEW_TOKENS)
    assert_matches(got, hf_greedy(deepseek, again, NEW_TOKENS), "PD DP attention after cut-off clients")
