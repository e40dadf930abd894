"""ModelConfig read the way transformers reads config.json: the config class's attribute map and
defaults, its head_dim rule per architecture, and fields the engine cannot honour refused by name."""

from __future__ import annotations

import pytest

from engine.models.config import ModelConfig

QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=512,
                 hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2,
                 head_dim=16, moe_intermediate_size=32, num_experts_per_tok=2, mlp_only_layers=[0],
                 norm_topk_prob=False)


def test_qwen3_moe_expert_count_under_its_stored_name():
    # what transformers 5.23 writes: num_experts lives under num_local_experts (its attribute map)
    moe = ModelConfig.from_dict({**QWEN3_MOE, "num_local_experts": 8}).moe
    assert moe is not None
    assert (moe.num_experts, moe.top_k, moe.sparse_layers, moe.normalize) == (8, 2, (1, 2), False)
    # the older spelling still reads the same
    assert ModelConfig.from_dict({**QWEN3_MOE, "num_experts": 8}).moe == moe


def test_missing_fields_take_the_config_class_defaults():
    from transformers import Qwen3MoeConfig

    raw = {k: v for k, v in QWEN3_MOE.items() if k not in ("num_experts_per_tok", "norm_topk_prob")}
    moe = ModelConfig.from_dict({**raw, "num_local_experts": 16}).moe
    assert moe is not None
    defaults = Qwen3MoeConfig()
    assert (moe.top_k, moe.normalize) == (defaults.num_experts_per_tok, defaults.norm_topk_prob)
    llama = ModelConfig.from_dict(dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512,
                                       hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                       num_attention_heads=4))
    from transformers import LlamaConfig

    assert llama.rms_norm_eps == LlamaConfig().rms_norm_eps
    assert llama.max_position_embeddings == LlamaConfig().max_position_embeddings


def test_qwen2_vl_attention_width_ignores_head_dim():
    from transformers import Qwen2VLConfig

    rope = {"rope_type": "default", "mrope_section": [8, 8, 8], "rope_theta": 1e6}
    config = Qwen2VLConfig(text_config=dict(vocab_size=512, hidden_size=96, num_attention_heads=2,
                                            num_key_value_heads=1, intermediate_size=64, num_hidden_layers=1,
                                            head_dim=32, rope_parameters=rope),
                           vision_config=dict(depth=1, embed_dim=32, hidden_size=96, num_heads=2),
                           image_token_id=500)
    raw = {**config.to_dict(), "architectures": ["Qwen2VLForConditionalGeneration"]}
    assert ModelConfig.from_dict(raw).head_dim == 48  # transformers' q_proj is 96 wide here


@pytest.mark.parametrize(("fields", "named"), [
    (dict(layer_types=["full_attention", "sliding_attention", "full_attention"]), "layer_types"),
    (dict(use_sliding_window=True, sliding_window=64, max_window_layers=0), "use_sliding_window"),
])
def test_sliding_layers_are_refused_by_name(fields, named):
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_dict({**QWEN3_MOE, "num_local_experts": 8, **fields})


def test_mixtral_sliding_window_is_refused_by_name():
    raw = dict(architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=512, hidden_size=64,
               intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_local_experts=4,
               sliding_window=128)
    with pytest.raises(ValueError, match="sliding_window 128"):
        ModelConfig.from_dict(raw)
    assert ModelConfig.from_dict({**raw, "sliding_window": None}).moe is not None
