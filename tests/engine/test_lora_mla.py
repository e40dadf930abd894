"""LoRA on DeepSeek (the tiny-deepseek preset: multi-head latent attention, a dense first layer, then
routed and shared experts): adapters on MLA's q_a/q_b/kv_a/o projections and on the routed experts
give HF's greedy tokens on PEFT's merged weights, beside the base model in one batch; kv_b_proj
(absorbed into the attention) and the shared experts are refused at load, naming why."""

from __future__ import annotations

import asyncio

import pytest
from safetensors.torch import load_file, save_file

from engine.lora.adapter import LoraLoadError, load_adapter
from engine.models.config import ModelConfig
from engine.sampling import SamplingParams
from tests.engine.conftest import generate, random_prompts, start_engine
from tests.engine.lora_adapters import AdapterSpec, merged_reference, write_adapter
from tools.models.tiny_model import write_tiny_model

NEW_TOKENS = 8
MLA = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")
SPECS = (
    AdapterSpec("mla8", 8, MLA, 16.0, 11),
    AdapterSpec("kv4", 4, ("kv_a_proj_with_mqa", "o_proj"), 4.0, 12,
                parameters=("mlp.experts.gate_up_proj",)),
)


@pytest.fixture(scope="module")
def deepseek_ckpt(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("ckpt") / "deepseek", preset="tiny-deepseek", seed=0)


async def test_mla_and_expert_adapters_in_one_batch_match_merged_peft(deepseek_ckpt, tmp_path):
    paths = tuple(f"{spec.name}={write_adapter(deepseek_ckpt, tmp_path / spec.name, spec)}" for spec in SPECS)
    prompts = random_prompts([5, 40], seed=13)
    want = {name: merged_reference(deepseek_ckpt, spec, prompts, NEW_TOKENS)
            for name, spec in [(None, None)] + [(spec.name, spec) for spec in SPECS]}
    assert len({str(answers) for answers in want.values()}) == len(want)  # each adapter changes the answers
    engine = start_engine(deepseek_ckpt, enable_lora=True, max_loras_per_batch=2, max_lora_rank=8,
                          lora_paths=paths)
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)

    async def run(name: str | None, index: int) -> list[int]:
        return [o.token_id async for o in generate(engine, prompts[index], params, f"mla-{name}-{index}",
                                                   lora=name)]

    try:
        names = list(want)
        got = await asyncio.gather(*(run(name, i) for name in names for i in range(len(prompts))))
        assert got == [want[name][i] for name in names for i in range(len(prompts))]
    finally:
        engine.shutdown()


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
