"""The checkpoint fuzzer's draws served as real processes: a few random configs (tests/engine/
checkpoint_draws.py, seeded by PDSERVE_FUZZ_SEED), each written by save_pretrained and served by a
colocated worker and by a mooncake prefill/decode pair, greedy fp32 tokens equal to transformers'.
The in-process fuzzer (tests/engine/test_checkpoint_fuzz.py) covers many more draws cheaply; this one
shows the draws survive the services (config read by every process, KV layout over the wire).
In `make test-all` (--long): about 40 s a draw here.
"""

from __future__ import annotations

import os
import random

import pytest

from tests.e2e.cluster import Cluster, wait_until, worker_args
from tests.e2e.hf import hf_greedy
from tests.e2e.test_moe_mla_pd import assert_matches, prompts_of
from tests.e2e.worker_client import run_all
from tests.engine.checkpoint_draws import DRAWERS, draw

pytestmark = [pytest.mark.e2e, pytest.mark.long, pytest.mark.timeout(600)]
NEW_TOKENS = 6
FLAGS = ("--chunked-prefill-size", "32", "--num-pages", "128", "--page-size", "8")
# one dense, one routed-experts and one latent-attention draw
ARCHITECTURES = ["Qwen3MoeForCausalLM", "LlamaForCausalLM", "DeepseekV3ForCausalLM"]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_served_draw_matches_transformers(cluster: Cluster, architecture, tmp_path):
    from tools.models.saved_checkpoint import save_random_checkpoint, write_tokenizer_files

    assert architecture in DRAWERS
    rng = random.Random(f"{os.environ.get('PDSERVE_FUZZ_SEED', '0')}-{architecture}")
    config = draw(architecture, rng)
    model = str(save_random_checkpoint(tmp_path / "draw", config, seed=rng.randrange(1 << 30),
                                       tokenizer_dir=write_tokenizer_files(tmp_path / "tokenizer")))
    prompts = prompts_of([3, 17, 40], seed=rng.randrange(1 << 30))
    bootstrap = cluster.bootstrap()
    colocated, prefill, decode = cluster.start_many([
        ("colocated", worker_args(model, "null", extra=FLAGS)),
        ("prefill", worker_args(model, "prefill", backend="mooncake", bootstrap=bootstrap, extra=FLAGS)),
        ("decode", worker_args(model, "decode", backend="mooncake", bootstrap=bootstrap, extra=FLAGS))], 240)
    expected = hf_greedy(model, prompts, NEW_TOKENS)
    what = f"{architecture} {config.to_diff_dict()}"
    assert_matches(run_all(colocated.address, prompts, max_new_tokens=NEW_TOKENS), expected,
                   f"colocated {what}")
    assert_matches(run_all(decode.address, prompts, [prefill.address] * len(prompts),
                           max_new_tokens=NEW_TOKENS), expected, f"PD {what}")
    for proc in (colocated, prefill, decode):
        wait_until(lambda proc=proc: proc.metric("pdserve:kv_pages_used") == 0, 30, f"{proc.name}'s pages")
