"""LoRA on a MoE model (the tiny-moe preset, Qwen3-MoE with one dense layer): an adapter on every
attention projection gives HF's greedy tokens on PEFT's merged weights, beside the base model in one
batch. What PEFT makes of MLP targets there is refused at load, naming it: with transformers 5's fused
expert tensors PEFT turns gate/up/down_proj into target_parameters on every routed layer's experts
(and leaves the dense layer's MLP out)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from engine.lora.adapter import LoraLoadError, load_adapter
from engine.models.config import ModelConfig
from engine.sampling import SamplingParams
from tests.engine.conftest import generate, random_prompts, start_engine
from tests.engine.lora_adapters import AdapterSpec, merged_reference, write_adapter
from tools.models.tiny_model import write_tiny_model

NEW_TOKENS = 8
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SPEC = AdapterSpec("moe8", 8, ("q_proj", "k_proj", "v_proj", "o_proj"), 16.0, 7)


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("ckpt") / "moe", preset="tiny-moe", seed=0)


async def test_attention_adapter_on_moe_matches_merged_peft(moe_ckpt, tmp_path):
    adapter = write_adapter(moe_ckpt, tmp_path / SPEC.name, SPEC)
    prompts = random_prompts([5, 40], seed=9)
    want = {name: merged_reference(moe_ckpt, spec, prompts, NEW_TOKENS) for name, spec in ((None, None),
                                                                                          (SPEC.name, SPEC))}
    assert want[None] != want[SPEC.name]
    engine = start_engine(moe_ckpt, enable_lora=True, max_loras_per_batch=1, max_lora_rank=8,
                          lora_paths=(f"{SPEC.name}={adapter}",))
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)

    async def run(name: str | None, index: int) -> list[int]:
        return [o.token_id async for o in generate(engine, prompts[index], params, f"moe-{name}-{index}",
                                                   lora=name)]

    try:
        names = [None, SPEC.name]
        got = await asyncio.gather(*(run(name, i) for name in names for i in range(len(prompts))))
        assert got == [want[name][i] for name in names for i in range(len(prompts))]
    finally:
        engine.shutdown()


def test_adapters_on_routed_experts_are_refused_naming_them(moe_ckpt, tmp_path):
    config = ModelConfig.from_dir(str(moe_ckpt))
    write_adapter(moe_ckpt, tmp_path / "all", AdapterSpec("all", 4, ALL, 8.0, 8))
    with pytest.raises(LoraLoadError, match=r"target_parameters \['down_proj', 'gate_up_proj'\]"):
        load_adapter("all", tmp_path / "all", config, 16, frozenset(ALL))
    model = AutoModelForCausalLM.from_pretrained(moe_ckpt, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                  target_parameters=["mlp.experts.gate_up_proj"]))
    peft_model.save_pretrained(tmp_path / "experts")
    with pytest.raises(LoraLoadError, match=r"target_parameters \['mlp.experts.gate_up_proj'\]"):
        load_adapter("experts", tmp_path / "experts", config, 16, frozenset(ALL))
    # the same weights without the config's word for them: refused by their names
    peft_config = tmp_path / "experts" / "adapter_config.json"
    peft_config.write_text(peft_config.read_text().replace('"target_parameters"', '"unused_parameters"'))
    with pytest.raises(LoraLoadError, match="targets mlp.experts of layer 0 .* LoRA on MoE experts"):
        load_adapter("experts", tmp_path / "experts", config, 16, frozenset(ALL))
