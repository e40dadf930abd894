"""LoRA on a MoE model (the tiny-moe preset, Qwen3-MoE with one dense layer): adapters on attention
and on the routed experts give HF's greedy tokens on PEFT's merged weights, beside the base model
and each other in one batch. With transformers 5's fused expert tensors PEFT adapts experts through
target_parameters (and rewrites gate/up/down_proj targets into them, at twice the rank and alpha on
the fused gate_up); what the engine cannot serve (shared experts or per-expert modules, other fused
parameters, another base's expert count) is refused at load, naming it."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine.lora.adapter import LoraLoadError, load_adapter
from engine.models.config import ModelConfig
from tests.engine.lora_adapters import AdapterSpec, check_one_batch_matches_merged, write_adapter
from tools.models.tiny_model import write_tiny_model

NEW_TOKENS = 8
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SPECS = (
    AdapterSpec("attn8", 8, ("q_proj", "k_proj", "v_proj", "o_proj"), 16.0, 7),
    # PEFT turns the MLP targets into target_parameters on every routed layer's experts
    AdapterSpec("all4", 4, ALL, 8.0, 8, rslora=True),
    AdapterSpec("down8", 8, ("o_proj",), 4.0, 9, parameters=("mlp.experts.down_proj",)),
)


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("ckpt") / "moe", preset="tiny-moe", seed=0)


async def test_attention_and_expert_adapters_in_one_batch_match_merged_peft(moe_ckpt, tmp_path):
    await check_one_batch_matches_merged(moe_ckpt, SPECS, tmp_path, prompt_seed=9, new_tokens=NEW_TOKENS,
                                         max_loras_per_batch=3, max_lora_rank=8)


def test_expert_adapters_are_read_per_expert(moe_ckpt, tmp_path):
    config = ModelConfig.from_dir(str(moe_ckpt))
    write_adapter(moe_ckpt, tmp_path / "all", SPECS[1])
    adapter = load_adapter("all", tmp_path / "all", config, 8, frozenset(ALL))
    routed = config.moe.sparse_layers
    assert sorted(adapter.experts) == [(layer, p) for layer in routed for p in ("down_proj", "gate_up_proj")]
    gate_up = adapter.experts[(routed[0], "gate_up_proj")]
    # PEFT fused gate_proj and up_proj at twice the rank and alpha: rsLoRA's 16 / sqrt(8)
    assert gate_up.a.shape == (8, 8, 256) and gate_up.b.shape == (8, 512, 8)
    assert gate_up.scaling == pytest.approx(16 / 8 ** 0.5)
    with pytest.raises(LoraLoadError, match=r"mlp.experts.gate_up_proj has rank 8, over --max-lora-rank 4"):
        load_adapter("all", tmp_path / "all", config, 4, frozenset(ALL))
    with pytest.raises(LoraLoadError, match="targets gate_proj, which --lora-target-modules"):
        load_adapter("all", tmp_path / "all", config, 8, frozenset(ALL) - {"gate_proj"})


def test_unservable_expert_adapters_are_refused_naming_why(moe_ckpt, tmp_path):
    config = ModelConfig.from_dir(str(moe_ckpt))
    model = AutoModelForCausalLM.from_pretrained(moe_ckpt, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                  target_parameters=["mlp.gate.weight"]))
    peft_model.save_pretrained(tmp_path / "router")
    with pytest.raises(LoraLoadError, match=r"target_parameters \['mlp.gate.weight'\] .* not supported"):
        load_adapter("router", tmp_path / "router", config, 16, frozenset(ALL))
    write_adapter(moe_ckpt, tmp_path / "down", SPECS[2])
    weights_file = tmp_path / "down" / "adapter_model.safetensors"
    tensors = load_file(weights_file)
    # per-expert modules (an older layout): refused by name
    renamed = {key.replace("mlp.experts.lora_A", "mlp.experts.3.down_proj.lora_A"): value
               for key, value in tensors.items()}
    save_file(renamed, weights_file)
    with pytest.raises(LoraLoadError, match="targets mlp.experts of layer 0 .* per-expert modules is not"):
        load_adapter("down", tmp_path / "down", config, 16, frozenset(ALL))
    # another base's expert count: its A rows are not a whole number of rank blocks
    cut = {key: value[:-4] if key.endswith("mlp.experts.lora_A.weight") else value
           for key, value in tensors.items()}
    save_file(cut, weights_file)
    with pytest.raises(LoraLoadError, match="fit none of this model's 8 experts' parameters"):
        load_adapter("down", tmp_path / "down", config, 16, frozenset(ALL))
