"""LoRA on DeepSeek (the tiny-deepseek preset: multi-head latent attention, a dense first layer, then
routed and shared experts): adapters on MLA's q_a/q_b/kv_a/o projections and on the routed experts
give HF's greedy tokens on PEFT's merged weights, beside the base model in one batch; kv_b_proj
(absorbed into the attention) and the shared experts are refused at load, naming why."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file, save_file

from engine.lora.adapter import LoraLoadError, load_adapter
from engine.models.config import ModelConfig
from tests.engine.lora_adapters import AdapterSpec, check_one_batch_matches_merged, write_adapter

NEW_TOKENS = 8
MLA = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")
SPECS = (
    AdapterSpec("mla8", 8, MLA, 16.0, 11),
    AdapterSpec("kv4", 4, ("kv_a_proj_with_mqa", "o_proj"), 4.0, 12,
                parameters=("mlp.experts.gate_up_proj",)),
)


# deepseek_ckpt: tests/engine/conftest.py's session checkpoint (tiny-deepseek, seed 0)
async def test_mla_and_expert_adapters_in_one_batch_match_merged_peft(deepseek_ckpt, tmp_path):
    await check_one_batch_matches_merged(deepseek_ckpt, SPECS, tmp_path, prompt_seed=13,
                                         new_tokens=NEW_TOKENS,
                                         max_loras_per_batch=2, max_lora_rank=8)


def test_unservable_mla_targets_are_refused_naming_why(deepseek_ckpt, tmp_path):
    config = ModelConfig.from_dir(str(deepseek_ckpt))
    allowed = frozenset(MLA + ("down_proj",))
    write_adapter(deepseek_ckpt, tmp_path / "kv_b", AdapterSpec("kv_b", 4, ("kv_b_proj",), 8.0, 1))
    with pytest.raises(LoraLoadError, match="targets self_attn.kv_b_proj .* absorbs it"):
        load_adapter("kv_b", tmp_path / "kv_b", config, 16, allowed)
    # PEFT (0.21) rewrites a shared_experts target into the routed experts' parameters: the shared
    # experts' own weights, named as a hand-made adapter would, are refused by name
    write_adapter(deepseek_ckpt, tmp_path / "shared", AdapterSpec("shared", 4, ("o_proj",), 8.0, 1))
    weights_file = tmp_path / "shared" / "adapter_model.safetensors"
    save_file({key.replace("self_attn.o_proj", "mlp.shared_experts.down_proj"): value
               for key, value in load_file(weights_file).items()}, weights_file)
    with pytest.raises(LoraLoadError, match="targets mlp.shared_experts of layer 0 .* shared experts"):
        load_adapter("shared", tmp_path / "shared", config, 16, allowed)
