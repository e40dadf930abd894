"""Expert parallelism: greedy output at TP 2 / EP 2 equals TP 1 and HF transformers.

Three routers and layouts: tiny-moe (Qwen3-MoE, 8 experts, one dense layer), a Mixtral of 4
experts (tests/engine/test_moe.py's, with 2 KV heads) and tiny-deepseek (V3: grouped sigmoid routing, a shared
expert kept column-split over TP, latent attention), each with the experts as per-expert Linears
(cpu_kernels off) and as the fused C++ op (on). Prompts of 1..150 tokens in chunks of 32, so steps
mix decodes and chunked extends (and some ranks' slice of a short step is empty). Also: TP 4 / EP 2
(two ranks per expert block, each expert's columns split between them, tokens exchanged within
each EP subgroup); a prefix-cache hit; the dispatch/combine on rank-local tokens (DP attention's
entry point) equals the single-rank experts bit for bit; EP sizes that do not fit are refused
before any rank starts; a fused-layout checkpoint loads each rank's block; `--moe-a2a-backend` says
at start what runs instead.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.config import EngineConfig
from engine.engine import Engine
from engine.models.config import ModelConfig
from engine.models.linear import Linear
from engine.models.moe import routed_experts_torch, run_grouped_experts
from engine.sampling import SamplingParams
from engine.tp import a2a_backend
from engine.tp.expert_parallel import ExpertParallel
from engine.tp.group import free_port
from engine.tp.shard import TPShard, UnshardableModel, check_tp_size
from services.worker.config import WorkerConfig
from tests.engine.conftest import random_prompts, run_in_turn, start_engine
from tests.engine.test_moe import LENGTHS, MIXTRAL_OVERRIDES, check_equal
from tests.engine.test_parity import NEW_TOKENS, engine_outputs, hf_reference
from tools.models.tiny_model import write_tiny_model

MODELS = {
    "qwen3_moe": dict(preset="tiny-moe", seed=0),
    # test_moe's Mixtral with 2 KV heads, so that TP 2 splits them.
    "mixtral": dict(preset="tiny-moe", seed=1, arch="mixtral",
                    **{**MIXTRAL_OVERRIDES, "num_key_value_heads": 2}),
    "deepseek_v3": dict(preset="tiny-deepseek", seed=0),
}


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(LENGTHS, seed=11)


@pytest.fixture(scope="module", params=list(MODELS))
def case(request, tmp_path_factory, prompts):
    ckpt = write_tiny_model(tmp_path_factory.mktemp("ckpt") / request.param, **MODELS[request.param])
    return request.param, ckpt, hf_reference(ckpt, prompts)


async def run(model_dir, prompts, **overrides):
    engine = start_engine(model_dir, chunked_prefill_size=32, num_threads=1, **overrides)
    try:
        got = await engine_outputs(engine, prompts)
        stats, load = engine.stats(), engine.expert_load()
    finally:
        engine.shutdown()
    assert stats.used_pages == 0
    return got, load


@pytest.mark.parametrize("cpu_kernels", ["off", "on"])
async def test_ep2_matches_tp1_and_hf(case, prompts, cpu_kernels):
    name, ckpt, expected = case
    tp1, tp1_load = await run(ckpt, prompts, cpu_kernels=cpu_kernels)
    check_equal(tp1, expected, f"{name} TP 1 cpu_kernels {cpu_kernels}")
    got, load = await run(ckpt, prompts, cpu_kernels=cpu_kernels, tp_size=2, ep_size=2)
    check_equal(got, expected, f"{name} TP 2 / EP 2 cpu_kernels {cpu_kernels} vs HF")
    assert [t for t, _ in got] == [t for t, _ in tp1], f"{name}: EP 2 differs from TP 1"
    # Rank 0 routes every token, so its counts are the whole model's, and TP 1's.
    assert load.tokens_per_expert == tp1_load.tokens_per_expert
    half = len(load.tokens_per_expert) // 2
    assert load.tokens_per_ep_rank == (sum(load.tokens_per_expert[:half]), sum(load.tokens_per_expert[half:]))
    assert load.a2a_sent_bytes == load.a2a_received_bytes > 0  # every row sent comes back
    assert tp1_load.tokens_per_ep_rank == () and tp1_load.a2a_sent_bytes == 0


async def test_two_ranks_per_expert_block(prompts, tmp_path):
    # TP 4 / EP 2: ranks {0, 2} and {1, 3} exchange tokens; ranks 0 and 1 split experts 0..3 by
    # columns (tiny-deepseek: MLA splits 4 query heads, so TP 4 fits).
    ckpt = write_tiny_model(tmp_path / "ds", **MODELS["deepseek_v3"])
    got, load = await run(ckpt, prompts, tp_size=4, ep_size=2, cpu_kernels="on")
    check_equal(got, hf_reference(ckpt, prompts), "deepseek TP 4 / EP 2")
    assert sum(load.tokens_per_ep_rank) == (sum(LENGTHS) + len(LENGTHS) * (NEW_TOKENS - 1)) * 2 * 3


async def test_prefix_cache_hit_under_ep(prompts, tmp_path):
    ckpt = write_tiny_model(tmp_path / "moe", **MODELS["qwen3_moe"])
    base = random_prompts([70], seed=3)[0]
    later = [base, base[:40] + random_prompts([9], seed=4)[0], base]
    engine = start_engine(ckpt, chunked_prefill_size=32, page_size=16, num_threads=1, tp_size=2, ep_size=2)
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)
    try:
        got = await run_in_turn(engine, later, params)  # one after another, so the later ones hit
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert stats.prefix_hit_tokens >= 32 + 64
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, hf_reference(ckpt, later), strict=True):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True)) < 1e-3


async def test_fused_checkpoint_layout_under_ep(prompts, tmp_path):
    # transformers' in-memory layout (all experts in one tensor): each EP rank slices its block out.
    published = write_tiny_model(tmp_path / "published", **MODELS["qwen3_moe"])
    fused = write_tiny_model(tmp_path / "fused", **MODELS["qwen3_moe"], fused_experts=True)
    expected, _ = await run(published, prompts, tp_size=2, ep_size=2)
    got, _ = await run(fused, prompts, tp_size=2, ep_size=2)
    assert got == expected


def _local_tokens_rank(rank: int, port: int) -> None:
    """One of 2 ranks: each routes its own tokens (as under DP attention: other counts, one rank
    sometimes none) and must get what one rank holding every expert computes, bit for bit."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        num_experts, hidden, width, top_k = 6, 32, 24, 2
        generator = torch.Generator().manual_seed(0)
        weights = [(torch.randn(2 * width, hidden, generator=generator),
                    torch.randn(hidden, width, generator=generator))
                   for _ in range(num_experts)]
        experts = [(Linear(g), Linear(d)) for g, d in weights]
        ep = ExpertParallel(rank, 2, num_experts, None, TPShard(0, 1))
        mine = experts[ep.first_expert:ep.first_expert + ep.num_local]

        for step, tokens in enumerate([(5, 3), (1, 0), (0, 4), (9, 9)]):
            count = tokens[rank]
            x = torch.randn(count, hidden, generator=torch.Generator().manual_seed(10 * step + rank))
            scores = torch.rand(count, num_experts,
                                generator=torch.Generator().manual_seed(100 * step + rank))
            route_weights, ids = scores.topk(top_k, dim=-1)
            got = ep.local(x, ids, route_weights,
                           lambda rows, counts: run_grouped_experts(mine, rows, counts))
            if count == 0:
                assert got.shape == (0, hidden)
                continue
            expected = routed_experts_torch(x, ids, route_weights, experts,
                                            torch.bincount(ids.view(-1), minlength=6))
            assert torch.equal(got, expected), f"rank {rank} step {step}"
    finally:
        dist.destroy_process_group()


def test_local_tokens_dispatch_and_combine():
    mp.spawn(_local_tokens_rank, args=(free_port("127.0.0.1"),), nprocs=2)


def _with_config(src, dst, **changes):
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_ep_size_that_does_not_divide_the_experts_is_refused(tmp_path):
    ckpt = write_tiny_model(tmp_path / "moe", **MODELS["qwen3_moe"])
    bad = _with_config(ckpt, tmp_path / "seven", num_experts=7)  # refused before the weights are read
    with pytest.raises(UnshardableModel, match="--ep-size 2 does not divide the model's 7 experts"):
        Engine.load(EngineConfig(model_path=str(bad), num_pages=16, tp_size=2, ep_size=2))
    # --moe-a2a-backend implies EP over every TP rank, so the same check names the implied size.
    with pytest.raises(UnshardableModel, match="--ep-size 2 does not divide the model's 7 experts"):
        Engine.load(EngineConfig(model_path=str(bad), num_pages=16, tp_size=2, moe_a2a_backend="deepep"))
    wide = _with_config(ckpt, tmp_path / "wide", num_key_value_heads=4, moe_intermediate_size=255)
    with pytest.raises(UnshardableModel,
                       match="--tp-size 4 / --ep-size 2: the 2 ranks sharing each expert block "
                                               "do not divide the expert width 255"):
        check_tp_size(4, ModelConfig.from_dir(wide), 2)
    check_tp_size(4, ModelConfig.from_dir(wide), 4)  # one rank per expert block: whole experts, no split


def test_ep_on_a_dense_model_is_refused(qwen3_ckpt):
    with pytest.raises(UnshardableModel, match="--ep-size 2: Qwen3ForCausalLM has no routed experts"):
        Engine.load(EngineConfig(model_path=str(qwen3_ckpt), num_pages=16, tp_size=2, ep_size=2))


def test_a2a_backends_fall_back_to_torch_distributed_naming_why():
    deepep = a2a_backend.resolve("deepep", "gloo")
    assert deepep.running == "torch.distributed"
    assert deepep.reason.startswith("--moe-a2a-backend deepep: DeepEP needs NVIDIA GPUs with NVSHMEM; "
                                    "`import deep_ep` failed: No module named 'deep_ep'")
    assert deepep.reason.endswith("using torch.distributed all_to_all over gloo instead: identical output, "
                                  "only speed differs")
    # The installed non-CUDA Mooncake wheel has mooncake/ep.py but not the extension it loads.
    mooncake = a2a_backend.resolve("mooncake", "gloo")
    assert "`import mooncake.ep` failed: Mooncake EP was not built" in mooncake.reason
    assert a2a_backend.resolve("none", "gloo").reason is None


async def test_a2a_backend_warns_once_at_start_and_serves(caplog, prompts, tmp_path):
    ckpt = write_tiny_model(tmp_path / "moe", **MODELS["qwen3_moe"])
    with caplog.at_level(logging.WARNING, logger="engine.tp.a2a_backend"):
        got, load = await run(ckpt, prompts[:3], tp_size=2, moe_a2a_backend="deepep",
                              elastic_ep_backend="mooncake")
    warnings = [r.getMessage() for r in caplog.records if r.name == "engine.tp.a2a_backend"]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("--moe-a2a-backend deepep: DeepEP needs NVIDIA GPUs")
    assert ("using torch.distributed all_to_all over gloo instead: identical output, only speed differs"
            in warnings[0])
    assert warnings[1].startswith("--elastic-ep-backend mooncake: not run; an expert-parallel rank that dies "
                                  "takes its worker down")
    assert len(load.tokens_per_ep_rank) == 2  # deepep implied EP over both TP ranks
    assert [t for t, _ in got] == [t for t, _ in hf_reference(ckpt, prompts[:3])]


def test_worker_config_refuses_ep_at_start(qwen3_ckpt):
    with pytest.raises(UnshardableModel, match="--ep-size 2: Qwen3ForCausalLM has no routed experts"):
        WorkerConfig(engine=EngineConfig(model_path=str(qwen3_ckpt), tp_size=2, ep_size=2))
