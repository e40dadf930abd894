"""`launch-server --engine sim`: real workers (servicers, KV pool, prefix cache, PD handshake and
transfer) around a timing model instead of a forward pass.

Greedy output through a simulated prefill + decode pair equals the simulated colocated worker's, and
both equal the simulator's token function over the whole context (engine/sim/runner.py), which a
decode worker can only reproduce from the hashes prefill wrote into the transferred pages. Pages go
back to idle afterwards; no weights are read.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from engine.models.config import ModelConfig
from engine.sim.load import sim_vocabulary
from engine.sim.runner import context_hash
from tests.e2e.cluster import Cluster, wait_until, worker_args
from tests.e2e.worker_client import run_all

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

LENGTHS = [1, 15, 16, 17, 100, 333]
NEW_TOKENS = 12
SIM = ("--engine", "sim", "--chunked-prefill-size", "64", "--num-pages", "256")


def expected_tokens(prompt: list[int], vocabulary: list[int]) -> list[int]:
    context = list(prompt)
    for _ in range(NEW_TOKENS):
        context.append(vocabulary[context_hash(context) % len(vocabulary)])
    return context[len(prompt):]


@pytest.fixture(scope="module")
def weightless_model(tiny_model, tmp_path_factory):
    """The tiny checkpoint's config and tokenizer without its weights file."""
    folder = tmp_path_factory.mktemp("sim-model")
    for path in tiny_model.iterdir():
        if not path.name.endswith(".safetensors"):
            (folder / path.name).write_bytes(path.read_bytes())
    return folder


def test_sim_pd_equals_sim_colocated_and_the_token_function(cluster: Cluster, weightless_model):
    vocabulary = sim_vocabulary(ModelConfig.from_dir(weightless_model),
                                AutoTokenizer.from_pretrained(str(weightless_model)))
    prompts = [[10 + (7 * i + n) % 3000 for i in range(n)] for n in LENGTHS]

    bootstrap = cluster.bootstrap()
    pair = [(role, worker_args(weightless_model, role, backend="mooncake", bootstrap=bootstrap, extra=SIM))
            for role in ("prefill", "decode")]
    colocated, prefill, decode = cluster.start_many(
        [("colocated", worker_args(weightless_model, "null", extra=SIM)), *pair])
    alone = run_all(colocated.address, prompts, max_new_tokens=NEW_TOKENS)
    pd = run_all(decode.address, prompts, [prefill.address] * len(prompts), max_new_tokens=NEW_TOKENS)
    for n, prompt, one, two in zip(LENGTHS, prompts, alone, pd, strict=True):
        assert one.code is None and two.code is None, (n, one.details, two.details)
        assert one.tokens == expected_tokens(prompt, vocabulary), f"{n}-token prompt: colocated"
        assert two.tokens == one.tokens, f"{n}-token prompt: PD differs from colocated"
    assert prefill.metric("pdserve:kv_transfer_bytes_total") > 0
    # A repeated prompt reuses the decode's cached pages: the answer is the same.
    again = run_all(decode.address, prompts[-1:], [prefill.address], max_new_tokens=NEW_TOKENS)
    assert again[0].tokens == pd[-1].tokens
    for proc in (colocated, prefill, decode):
        wait_until(lambda proc=proc: proc.metric("pdserve:kv_pages_used") == 0, 30,
                   f"{proc.name}'s pages to be idle")
    assert "KV pages of 16 tokens" in decode.log()
