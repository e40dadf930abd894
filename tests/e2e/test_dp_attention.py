"""A colocated worker with DP attention (`--tp-size 2 --dp-size 2 --enable-dp-attention`), as real
processes: greedy output of concurrent requests equals HF transformers on the tiny DeepSeek (MLA +
routed experts), the requests are spread over both groups, and every page is free afterwards.
DP attention on a prefill or decode worker is refused at start with a message saying why."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.e2e.cluster import Cluster, wait_until, worker_args
from tests.e2e.test_moe_mla_pd import LENGTHS, NEW_TOKENS, assert_matches, hf_greedy, prompts_of
from tests.e2e.worker_client import run_all
from tools.models.tiny_model import write_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

DP2 = ("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--chunked-prefill-size", "64",
       "--num-pages", "128")


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("e2e-model") / "deepseek", preset="tiny-deepseek", seed=3)


def test_colocated_dp_attention_matches_hf(cluster: Cluster, deepseek):
    worker = cluster.worker("colocated-dp2", deepseek, "null", extra=DP2)
    prompts = prompts_of(LENGTHS, seed=51)
    got = run_all(worker.address, prompts, max_new_tokens=NEW_TOKENS)
    assert_matches(got, hf_greedy(deepseek, prompts), "colocated TP 2 in 2 DP attention groups")
    assert worker.metric("pdserve:moe_expert_tokens_total") > 0
    wait_until(lambda: worker.metric("pdserve:kv_pages_used") == 0, 30, "the worker's pages to be free")


def test_dp_attention_on_a_pd_worker_is_refused(deepseek):
    proc = subprocess.run([sys.executable, "-m", "pdserve", *worker_args(deepseek, "prefill", extra=DP2)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--enable-dp-attention runs on colocated workers" in proc.stdout + proc.stderr
