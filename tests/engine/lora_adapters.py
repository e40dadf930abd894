"""PEFT LoRA adapters for the tiny checkpoints, made with `peft` itself (never downloaded), and HF's
greedy reference on PEFT's merged weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    rank: int
    targets: tuple[str, ...]
    alpha: float
    seed: int
    rslora: bool = False
    parameters: tuple[str, ...] = ()  # PEFT's target_parameters (a MoE layer's fused expert tensors)


# Three adapters of different ranks, targets and scalings (rsLoRA on one).
SPECS = (
    AdapterSpec("qv4", 4, ("q_proj", "v_proj"), 8.0, 1),
    AdapterSpec("all8", 8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                8.0, 2, rslora=True),
    AdapterSpec("mlp16", 16, ("o_proj", "gate_proj", "up_proj", "down_proj"), 16.0, 3),
)


def _peft_model(base_dir: Path, spec: AdapterSpec):
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets),
                        use_rslora=spec.rslora, lora_dropout=0.0,
                        target_parameters=list(spec.parameters) or None)
    peft_model = get_peft_model(model, config)
    # PEFT starts B at zero (a no-op adapter): random A and B so the adapter changes the answers
    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return peft_model


def write_adapter(base_dir: Path, out_dir: Path, spec: AdapterSpec) -> Path:
    """Save a PEFT adapter folder (adapter_config.json, adapter_model.safetensors) for `base_dir`."""
    _peft_model(base_dir, spec).save_pretrained(out_dir)
    return out_dir


def merged_reference(base_dir: Path, spec: AdapterSpec | None, prompts: list[list[int]],
                     new_tokens: int) -> list[list[int]]:
    """HF's greedy tokens on the base, or on the base with the adapter's weights merged by PEFT."""
    if spec is None:
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    else:
        model = _peft_model(base_dir, spec).merge_and_unload()
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


async def check_one_batch_matches_merged(base_dir: Path, specs: tuple[AdapterSpec, ...], work_dir: Path,
                                         prompt_seed: int, new_tokens: int, **engine_overrides) -> None:
    """The base and every adapter of `specs`, their requests in one batch, each give HF's greedy tokens
    on PEFT's merged weights (and each adapter changes the answers, so the check can fail)."""
    import asyncio

    from engine.sampling import SamplingParams
    from tests.engine.conftest import generate, random_prompts, start_engine

    paths = tuple(f"{spec.name}={write_adapter(base_dir, work_dir / spec.name, spec)}" for spec in specs)
    prompts = random_prompts([5, 40], seed=prompt_seed)
    want = {name: merged_reference(base_dir, spec, prompts, new_tokens)
            for name, spec in [(None, None)] + [(spec.name, spec) for spec in specs]}
    assert len({str(answers) for answers in want.values()}) == len(want)
    engine = start_engine(base_dir, enable_lora=True, lora_paths=paths, **engine_overrides)
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)

    async def run(name: str | None, index: int) -> list[int]:
        return [o.token_id async for o in generate(engine, prompts[index], params, f"lora-{name}-{index}",
                                                   lora=name)]

    try:
        names = list(want)
        got = await asyncio.gather(*(run(name, i) for name in names for i in range(len(prompts))))
        assert got == [want[name][i] for name in names for i in range(len(prompts))]
    finally:
        engine.shutdown()
