"""DeepSeek V3/V2 (MLA + routed experts), Qwen3-MoE and Mixtral served disaggregated, as real processes.

Greedy output of concurrent requests (1 to 300 tokens, prefill chunks of 64) through a prefill and a
decode worker equals HF transformers' on the tiny-deepseek (V3) and tiny-moe (Qwen3-MoE) presets and
on a V2 and a Mixtral written with other dimensions, on mooncake and nixl, and from a TP 1 prefill
to a TP 2 decode. A second round of prompts that extend the first
ones hits the prefill's prefix cache and still matches. An MLA model ships its latent pages: the
bytes prefill sent are exactly the pages' bytes, once per decode rank (not once per prefill rank
or per head). After the requests every worker's KV pages are free again.
"""

from __future__ import annotations

import pytest
import torch

from engine.models.config import ModelConfig
from tests.e2e.cluster import Cluster, wait_until, worker_args
from tests.e2e.hf import hf_greedy
from tests.e2e.matrix import cover
from tests.e2e.worker_client import run_all
from tools.models.tiny_model import write_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

LENGTHS = [1, 5, 17, 64, 130, 300]
NEW_TOKENS = 8
PAGE_SIZE = 16
CHUNK = ("--chunked-prefill-size", "64", "--num-pages", "256", "--page-size", str(PAGE_SIZE))


@pytest.fixture(scope="session")
def deepseek_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("e2e-model") / "deepseek", preset="tiny-deepseek", seed=3)


@pytest.fixture(scope="session")
def moe_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("e2e-model") / "moe", preset="tiny-moe", seed=4)


@pytest.fixture(scope="session")
def deepseek_v2_model(tmp_path_factory):
    # V2: softmax scores, group_limited_greedy, no q LoRA, and a latent of 64 + rope 16.
    return write_tiny_model(tmp_path_factory.mktemp("e2e-model") / "deepseek-v2", preset="tiny-deepseek",
                            seed=5, arch="deepseek_v2", scoring_func="softmax",
                            topk_method="group_limited_greedy", q_lora_rank=None, kv_lora_rank=64,
                            qk_rope_head_dim=16)


@pytest.fixture(scope="session")
def mixtral_model(tmp_path_factory):
    # Mixtral: 4 experts of width 192, two KV heads of 32 (TP 2 splits them), untied embeddings.
    return write_tiny_model(tmp_path_factory.mktemp("e2e-model") / "mixtral", preset="tiny-moe", seed=6,
                            arch="mixtral", num_local_experts=4, num_experts_per_tok=2, intermediate_size=192,
                            head_dim=32, num_key_value_heads=2, tie_word_embeddings=False)


MODELS = ["deepseek_model", "moe_model", "deepseek_v2_model", "mixtral_model"]
MLA_MODELS = ("deepseek_model", "deepseek_v2_model")


def prompts_of(lengths: list[int], seed: int = 21) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 4000, (n,), generator=generator).tolist() for n in lengths]


def assert_matches(results, expected, what: str) -> None:
    for prompt_index, (result, hf_tokens) in enumerate(zip(results, expected, strict=True)):
        assert result.code is None, f"{what}: prompt {prompt_index} failed: {result.code} {result.details}"
        assert result.tokens == hf_tokens, f"{what}: prompt {prompt_index} differs from HF transformers"


def pages_of(prompts) -> int:
    return sum(-(-len(p) // PAGE_SIZE) for p in prompts)


# Each model once in `make test`, on alternating backends; every pair in `make test-all` (matrix.py).
@pytest.mark.parametrize(("model_name", "backend"), cover(MODELS, ["mooncake", "nixl"]))
def test_pd_matches_hf_with_prefix_hits(cluster: Cluster, model_name, backend, request):
    model = request.getfixturevalue(model_name)
    first = prompts_of(LENGTHS)
    # Each extends a prompt of the first round by 20 tokens: its earlier pages are prefix-cache hits.
    second = [p + q for p, q in zip(first[2:], prompts_of([20] * 4, seed=22), strict=True)]
    bootstrap = cluster.bootstrap()
    prefill, decode = cluster.start_many([
        ("prefill", worker_args(model, "prefill", backend=backend, bootstrap=bootstrap, extra=CHUNK)),
        ("decode", worker_args(model, "decode", backend=backend, bootstrap=bootstrap, extra=CHUNK)),
    ])
    expected = hf_greedy(model, first + second, NEW_TOKENS)
    assert_matches(run_all(decode.address, first, [prefill.address] * len(first), max_new_tokens=NEW_TOKENS),
                   expected[:len(first)], f"{backend} PD")
    sent_before = prefill.metric("pdserve:kv_transfer_bytes_total")
    if model_name in MLA_MODELS:
        # MLA: the latent pages of every prompt, whole, once (the prefix cache was cold).
        layout = ModelConfig.from_dir(model).kv_layout(PAGE_SIZE, torch.float32)
        assert layout.is_mla
        assert sent_before == pages_of(first) * layout.page_nbytes
    hits_before = prefill.metric("pdserve:prefix_cache_hit_tokens_total")
    assert_matches(run_all(decode.address, second, [prefill.address] * len(second),
                           max_new_tokens=NEW_TOKENS),
                   expected[len(first):], f"{backend} PD, prefix-cache hits")
    assert prefill.metric("pdserve:prefix_cache_hit_tokens_total") > hits_before
    # Tokens were routed to experts, and the workers say so.
    assert prefill.metric("pdserve:moe_expert_tokens_total") > 0
    for proc in (prefill, decode):
        wait_until(lambda proc=proc: proc.metric("pdserve:kv_pages_used") == 0, 30,
                   f"{proc.name}'s pages to be free")


# The latent (DeepSeek V3) and routed-expert (Qwen3-MoE) models in `make test`, all four in `make test-all`.
@pytest.mark.parametrize("model_name", [m if m in ("deepseek_model", "moe_model") else
                                        pytest.param(m, marks=pytest.mark.long) for m in MODELS])
def test_pd_tp1_to_tp2_matches_hf(cluster: Cluster, model_name, request):
    model = request.getfixturevalue(model_name)
    prompts = prompts_of(LENGTHS, seed=23)
    bootstrap = cluster.bootstrap()
    no_cache = (*CHUNK, "--disable-radix-cache")
    prefill, decode = cluster.start_many([
        ("prefill", worker_args(model, "prefill", backend="mooncake", bootstrap=bootstrap,
                                extra=(*no_cache, "--tp-size", "1"))),
        ("decode", worker_args(model, "decode", backend="mooncake", bootstrap=bootstrap,
                               extra=(*no_cache, "--tp-size", "2"))),
    ])
    got = run_all(decode.address, prompts, [prefill.address] * len(prompts), max_new_tokens=NEW_TOKENS)
    assert_matches(got, hf_greedy(model, prompts, NEW_TOKENS), "PD TP 1 -> 2")
    if model_name in MLA_MODELS:
        # Both decode ranks need the whole latent: each page crosses once per decode rank.
        layout = ModelConfig.from_dir(model).kv_layout(PAGE_SIZE, torch.float32)
        assert prefill.metric("pdserve:kv_transfer_bytes_total") == 2 * pages_of(prompts) * layout.page_nbytes
    for proc in (prefill, decode):
        wait_until(lambda proc=proc: proc.metric("pdserve:kv_pages_used") == 0, 30,
                   f"{proc.name}'s pages to be free")
