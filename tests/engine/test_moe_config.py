"""MoEConfig from config.json: which layers are routed and how, per architecture; settings the
engine does not implement are refused naming the field and value; TP must divide the expert width."""

from __future__ import annotations

import pytest

from engine.models.config import ModelConfig
from engine.models.moe_config import MoEConfig
from engine.tp.shard import UnshardableModel, check_tp_size
from tools.models.tiny_model import PRESETS, model_config


def test_dense_architectures_have_none():
    assert MoEConfig.from_dict(model_config(PRESETS["tiny"]), "Qwen3ForCausalLM") is None
    assert ModelConfig.from_dict(model_config(PRESETS["tiny"], "llama")).moe is None


def test_qwen3_moe_layers_and_routing():
    moe = ModelConfig.from_dict(model_config(PRESETS["tiny-moe"])).moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.sparse_layers) == (8, 2, 256, (0, 2, 3))
    assert moe.normalize and moe.weights_in_model_dtype and not moe.router_fp32 and moe.scoring == "softmax"
    raw = model_config(PRESETS["tiny-moe"], decoder_sparse_step=2, mlp_only_layers=[3], num_hidden_layers=6)
    assert MoEConfig.from_dict(raw, "Qwen3MoeForCausalLM").sparse_layers == (1, 5)
    assert MoEConfig.from_dict({**raw, "num_experts": 0}, "Qwen3MoeForCausalLM") is None


def test_mixtral_routes_every_layer_normalised():
    raw = model_config(PRESETS["tiny-moe"], "mixtral", num_local_experts=4, intermediate_size=192)
    moe = ModelConfig.from_dict(raw).moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.sparse_layers) == (4, 2, 192, (0, 1, 2, 3))
    assert moe.normalize and not moe.weights_in_model_dtype


def test_deepseek_v3_and_v2():
    raw = model_config(PRESETS["tiny-deepseek"])
    v3 = MoEConfig.from_dict(raw, "DeepseekV3ForCausalLM")
    assert ((v3.num_experts, v3.top_k, v3.sparse_layers, v3.num_groups, v3.topk_groups)
            == (8, 2, (1, 2, 3), 4, 2))
    assert (v3.scoring, v3.topk_method, v3.normalize, v3.scaling_factor) == ("sigmoid", "noaux_tc", True, 2.5)
    assert v3.shared_intermediate_size == 256 and v3.router_fp32
    v2 = MoEConfig.from_dict(model_config(PRESETS["tiny-deepseek"], "deepseek_v2", scoring_func="softmax",
                                          topk_method="group_limited_greedy"), "DeepseekV2ForCausalLM")
    assert ((v2.scoring, v2.topk_method, v2.num_groups, v2.normalize)
            == ("softmax", "group_limited_greedy", 4, False))
    greedy = MoEConfig.from_dict({**raw, "scoring_func": "softmax", "topk_method": "greedy"},
                                 "DeepseekV2ForCausalLM")
    assert (greedy.num_groups, greedy.topk_groups) == (1, 1)


@pytest.mark.parametrize(("arch", "change", "message"), [
    ("DeepseekV3ForCausalLM", {"topk_method": "greedy"}, "topk_method 'greedy'"),
    ("DeepseekV3ForCausalLM", {"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ("DeepseekV2ForCausalLM", {"scoring_func": "softmax", "topk_method": "noaux_tc"},
     "topk_method 'noaux_tc'"),
    ("DeepseekV2ForCausalLM", {"scoring_func": "sigmoid", "topk_method": "greedy"}, "scoring_func 'sigmoid'"),
    ("DeepseekV3ForCausalLM", {"moe_layer_freq": 2}, "moe_layer_freq 2"),
    ("DeepseekV3ForCausalLM", {"n_group": 3}, "n_group 3"),
    ("DeepseekV3ForCausalLM", {"n_group": 8}, "n_group 8"),  # one expert per group: no top-2 to sum
    ("DeepseekV3ForCausalLM", {"topk_group": 5}, "topk_group 5"),
    ("DeepseekV3ForCausalLM", {"topk_group": 1, "num_experts_per_tok": 3}, "num_experts_per_tok 3"),
    ("Qwen3MoeForCausalLM", {"num_experts_per_tok": 9}, "num_experts_per_tok 9"),
])
def test_unsupported_settings_are_refused(arch, change, message):
    preset = "tiny-deepseek" if arch.startswith("Deepseek") else "tiny-moe"
    with pytest.raises(ValueError, match=message):
        MoEConfig.from_dict(model_config(PRESETS[preset], **change), arch)


def test_tp_size_must_divide_the_expert_width():
    config = ModelConfig.from_dict(model_config(PRESETS["tiny-moe"], moe_intermediate_size=255))
    check_tp_size(1, config)
    with pytest.raises(UnshardableModel, match="--tp-size 2: tp size 2 does not divide the expert width 255"):
        check_tp_size(2, config)
