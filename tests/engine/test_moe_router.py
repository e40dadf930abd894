"""The engine's router and MoE block against transformers' own modules, on the same weights.

Routers (Qwen3-MoE, Mixtral, DeepSeek V2 greedy and group-limited, DeepSeek V3 noaux_tc) must
choose the same experts with the same weights for random inputs; the DeepSeek V3 MoE block (routed
plus shared experts) must give DeepseekV3MoE's (and DeepseekV2Moe's) output from either checkpoint
layout, and its two tensor-parallel halves must sum to it. MoEConfig is built from each HF config's
`to_dict()`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import DeepseekV2Config, DeepseekV3Config, MixtralConfig, Qwen3MoeConfig
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe, DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE, DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from engine.models.moe import MoEBlock, Router
from engine.models.moe_config import MoEConfig
from engine.models.weights import CheckpointReader, ShardedReader
from engine.tp.shard import TPShard
from tools.models.tiny_model import published_layout

HIDDEN = 64
DEEPSEEK = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, n_routed_experts=8,
                num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=32,
                first_k_dense_replace=1)


def _random_(module: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.5)


def _same_routing(hf_router, arch: str, hf_config, dtype=torch.float32) -> None:
    _random_(hf_router, seed=1)
    hf_router.to(dtype)
    moe = MoEConfig.from_dict(hf_config.to_dict(), arch)
    bias = getattr(hf_router, "e_score_correction_bias", None)
    router = Router(moe, hf_router.weight.detach(), bias)
    x = torch.randn(512, HIDDEN, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf_router(x)
        packed_ids, packed_weights = router(x)
        # The engine's gate matmul is a prepacked oneDNN Linear (batch-invariant), whose sums round
        # differently from F.linear's; with F.linear in its place, the recipe must be bit-exact.
        weight = hf_router.weight.detach().to(torch.float32 if moe.router_fp32 else dtype)
        router.gate = lambda rows: F.linear(rows, weight)
        ids, weights = router(x)
    # Order within a token's top-k is free (sorted=False); compare by expert id.
    hf_ids, hf_order = hf_ids.sort(dim=-1)
    ids, order = ids.sort(dim=-1)
    assert torch.equal(ids, hf_ids)
    assert weights.dtype == hf_weights.dtype
    assert torch.equal(weights.gather(1, order), hf_weights.gather(1, hf_order))
    # Packed: the same experts but for near ties, weights equal to rounding.
    packed_ids, packed_order = packed_ids.sort(dim=-1)
    same = (packed_ids == hf_ids).all(dim=-1)
    assert same.float().mean() > 0.99
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(packed_weights.gather(1, packed_order)[same],
                               hf_weights.gather(1, hf_order)[same],
                               rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(("dtype", "norm"),
                         [(torch.float32, True), (torch.float32, False), (torch.bfloat16, True)])
def test_qwen3_moe_router(dtype, norm):
    config = Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=8, num_experts_per_tok=2, norm_topk_prob=norm)
    _same_routing(Qwen3MoeTopKRouter(config), "Qwen3MoeForCausalLM", config, dtype)


def test_mixtral_router():
    config = MixtralConfig(hidden_size=HIDDEN, num_local_experts=8, num_experts_per_tok=2)
    _same_routing(MixtralTopKRouter(config), "MixtralForCausalLM", config)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_router(method):
    # norm_topk_prob is set, but transformers' V2 router never renormalises, nor does the engine's.
    config = DeepseekV2Config(**DEEPSEEK, topk_method=method, norm_topk_prob=True, routed_scaling_factor=1.5)
    assert MoEConfig.from_dict(config.to_dict(), "DeepseekV2ForCausalLM").normalize is False
    _same_routing(DeepseekV2TopkRouter(config), "DeepseekV2ForCausalLM", config)


@pytest.mark.parametrize("norm", [True, False])
def test_deepseek_v3_router(norm):
    config = DeepseekV3Config(**DEEPSEEK, norm_topk_prob=norm, routed_scaling_factor=2.5)
    _same_routing(DeepseekV3TopkRouter(config), "DeepseekV3ForCausalLM", config)


def _block(tensors: dict[str, torch.Tensor], folder, moe: MoEConfig, shard: TPShard | None = None,
           dtype: torch.dtype = torch.float32) -> MoEBlock:
    folder.mkdir(exist_ok=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(folder / "model.safetensors"))
    reader = ShardedReader(CheckpointReader(folder), torch.device("cpu"), dtype, shard)
    config = SimpleNamespace(moe=moe, hidden_size=HIDDEN, architecture="DeepseekV3ForCausalLM")
    return MoEBlock.load(reader, "model.layers.1.", config)


@pytest.mark.parametrize(("arch", "layout"), [("v3", "fused"), ("v3", "published"), ("v2", "published")])
def test_deepseek_block_matches_hf(arch, layout, tmp_path):
    if arch == "v3":
        config, architecture = DeepseekV3Config(**DEEPSEEK, n_shared_experts=2), "DeepseekV3ForCausalLM"
        hf_block = DeepseekV3MoE(config).eval()
    else:
        config = DeepseekV2Config(**DEEPSEEK, n_shared_experts=2, topk_method="group_limited_greedy")
        architecture, hf_block = "DeepseekV2ForCausalLM", DeepseekV2Moe(config).eval()
    _random_(hf_block, seed=3)
    moe = MoEConfig.from_dict(config.to_dict(), architecture)
    assert moe.sparse_layers == (1,) and moe.shared_intermediate_size == 64
    tensors = {f"model.layers.1.mlp.{name}": t for name, t in hf_block.state_dict().items()}
    if layout == "published":
        tensors = published_layout(tensors, f"deepseek_{arch}")
        assert "model.layers.1.mlp.experts.7.up_proj.weight" in tensors
    block = _block(tensors, tmp_path / "full", moe)
    x = torch.randn(300, HIDDEN, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf_block(x[None])[0]
    torch.testing.assert_close(block(x), expected, rtol=1e-4, atol=1e-4)
    assert int(block.routed_tokens.sum()) == 300 * 2

    halves = [_block(tensors, tmp_path / f"rank{r}", moe, TPShard(r, 2))(x) for r in range(2)]
    # The split changes only the order of the down projections' sums (fp32 rounding).
    torch.testing.assert_close(halves[0] + halves[1], expected, rtol=1e-4, atol=1e-4)


def test_deepseek_v3_correction_bias_stays_fp32_in_bf16(tmp_path):
    # transformers keeps it in fp32 (_keep_in_fp32_modules_strict): rounding it to bf16 would
    # merge experts whose biases differ in the fourth digit.
    config = DeepseekV3Config(**DEEPSEEK)
    hf_block = DeepseekV3MoE(config)
    _random_(hf_block, seed=5)
    tensors = {f"model.layers.1.mlp.{name}": t for name, t in hf_block.state_dict().items()}
    moe = MoEConfig.from_dict(config.to_dict(), "DeepseekV3ForCausalLM")
    block = _block(tensors, tmp_path / "bf16", moe, dtype=torch.bfloat16)
    bias = tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert block.router.correction_bias.dtype == torch.float32
    assert torch.equal(block.router.correction_bias, bias)
    assert block(torch.randn(5, HIDDEN).bfloat16()).dtype == torch.bfloat16
