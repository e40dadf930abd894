"""Multi-LoRA serving in the engine: PEFT adapters of different ranks and targets in one batch
give HF's greedy tokens on PEFT's merged weights (fp32), the base model's answers beside them are
unchanged, no cached page is shared across adapters, and bad adapters are refused at load naming why."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch

from engine.config import EngineConfig
from engine.lora.adapter import LoraLoadError, UnknownLoraAdapter, load_adapter
from engine.lora.ops import lora_delta, lora_delta_reference, slot_mask
from engine.lora.setup import check_lora_flags
from engine.lora.slots import LoraSlots
from engine.models.config import ModelConfig
from engine.request import EngineRequest
from engine.sampling import SamplingParams
from kernels import cpu_kernels
from tests.engine.conftest import generate, random_prompts, start_engine
from tests.engine.lora_adapters import SPECS, AdapterSpec, merged_reference, write_adapter
from tests.kernels.lora_case import random_pool

NEW_TOKENS = 8
ALL_MODULES = frozenset(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))


@pytest.fixture(scope="module")
def adapters(qwen3_ckpt, tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("lora")
    return {spec.name: str(write_adapter(qwen3_ckpt, folder / spec.name, spec)) for spec in SPECS}


def test_batched_delta_matches_per_row_reference():
    generator = torch.Generator().manual_seed(0)
    a, bt = random_pool(3, 4, (0, 16, 32, 48), 32, [4, 2, 3], seed=0)
    x = torch.randn(7, 32, generator=generator)
    row_slots = torch.tensor([2, -1, 0, 0, 1, -1, 2])
    scales = torch.tensor([0.5, 2.0, 1.5])
    got = lora_delta(x, a, bt, slot_mask(row_slots, scales, 12, x.dtype))
    want = lora_delta_reference(x, a, bt, row_slots, scales)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert torch.equal(got[1], torch.zeros(48)) and torch.equal(got[5], torch.zeros(48))
    # each row sees only its own slot: row 0 by hand
    by_hand = 1.5 * bt[24:].t() @ (a[24:] @ x[0])
    torch.testing.assert_close(got[0], by_hand, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not cpu_kernels.available(), reason="the C++ CPU kernels are not built (make setup)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_matches_reference(dtype):
    generator = torch.Generator().manual_seed(1)
    # q/k/v-like sub-modules of unequal widths, none a multiple of 16 (the vector tails); slot ranks
    # under the pool's rank; more rows of one slot than a block holds
    bounds, rank = (0, 40, 58, 76), 8
    ranks = [8, 3, 0, 5]  # slot 2 empty
    a, bt = random_pool(4, rank, bounds, 40, ranks, seed=1, dtype=dtype)
    x = torch.randn(11, 40, generator=generator).to(dtype)
    base = torch.randn(11, 76, generator=generator).to(dtype)
    row_slots = torch.tensor([3, -1, 0, 0, 1, -1, 2, 3, 3, 3, 3])
    scales = torch.tensor([0.5, 2.0, 1.5, 0.25])
    got = cpu_kernels.lora_delta_add(base.clone(), x, a, bt, row_slots, scales, torch.tensor(ranks), bounds)
    want = base.float() + lora_delta_reference(x, a, bt, row_slots, scales).float()
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance)
    assert torch.equal(got[1], base[1]) and torch.equal(got[5], base[5])  # base rows untouched
    assert torch.equal(got[6], base[6])  # a row of an empty slot too
    # a row's result does not depend on the rows beside it (batch invariance)
    alone = cpu_kernels.lora_delta_add(base[7:8].clone(), x[7:8], a, bt, row_slots[7:8], scales,
                                       torch.tensor(ranks), bounds)
    assert torch.equal(alone[0], got[7])


PROMPTS = random_prompts([9, 40], seed=3)  # one prompt under a page, one over two pages


@pytest.fixture(scope="module")
def merged_answers(qwen3_ckpt, adapters) -> dict[str | None, list[list[int]]]:
    """HF's greedy tokens for PROMPTS on the base (None) and on each adapter merged by PEFT."""
    specs: dict[str | None, AdapterSpec | None] = {None: None, **{s.name: s for s in SPECS}}
    return {name: merged_reference(qwen3_ckpt, spec, PROMPTS, NEW_TOKENS) for name, spec in specs.items()}


@pytest.mark.parametrize("cpu_kernels", ["on", "off"])  # kernels/csrc/lora.cpp, then ops.lora_delta
async def test_three_adapters_and_base_in_one_batch_match_merged_peft(qwen3_ckpt, adapters, merged_answers,
                                                                      cpu_kernels):
    prompts, want = PROMPTS, merged_answers
    names: list[str | None] = [None, *adapters]
    assert len({tuple(want[name][1]) for name in names}) == len(names)  # every adapter changes the answer
    engine = start_engine(qwen3_ckpt, enable_lora=True, max_loras_per_batch=3, max_lora_rank=16,
                          lora_paths=tuple(f"{n}={p}" for n, p in adapters.items()), cpu_kernels=cpu_kernels)
    assert engine.lora is not None and engine.lora.cpu_kernel == (cpu_kernels == "on")
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)

    async def run(tag: str, name: str | None, index: int) -> list[int]:
        outputs = [o async for o in generate(engine, prompts[index], params, f"{tag}-{name}-{index}",
                                             lora=name)]
        return [o.token_id for o in outputs]

    try:
        # twice: the second round's prompts hit the pages the first cached (under their own adapter)
        for tag in ("cold", "warm"):
            jobs = [run(tag, name, i) for name in names for i in range(len(prompts))]
            got = await asyncio.gather(*jobs)
            expected = [want[name][i] for name in names for i in range(len(prompts))]
            assert got == expected
        assert engine.stats().prefix_hit_tokens > 0
        hashes = {name: engine.prompt_hashes(prompts[1], lora=name) for name in names}
        assert len({h[0] for h in hashes.values() if h}) == len(names)  # no page shared across adapters
        with pytest.raises(UnknownLoraAdapter, match="does not exist"):
            engine.check(EngineRequest("x", prompts[0], params, lora="nope"))
    finally:
        engine.shutdown()


def test_bad_adapters_are_refused_naming_why(qwen3_ckpt, llama_ckpt, adapters, tmp_path):
    config = ModelConfig.from_dir(str(qwen3_ckpt))
    with pytest.raises(LoraLoadError, match="rank 8 is over --max-lora-rank 4"):
        load_adapter("all8", adapters["all8"], config, 4, ALL_MODULES)
    with pytest.raises(LoraLoadError, match="targets q_proj, which --lora-target-modules"):
        load_adapter("qv4", adapters["qv4"], config, 16, frozenset({"v_proj", "o_proj"}))
    other = write_adapter(llama_ckpt, tmp_path / "llama", AdapterSpec("x", 4, ("q_proj",), 8.0, 0))
    with pytest.raises(LoraLoadError, match="another base model"):
        load_adapter("llama", other, config, 16, ALL_MODULES)
    missing = tmp_path / "missing"
    shutil.copytree(adapters["qv4"], missing)
    (missing / "adapter_model.safetensors").unlink()
    with pytest.raises(LoraLoadError, match="adapter_model.safetensors is missing"):
        load_adapter("missing", missing, config, 16, ALL_MODULES)
    dora = tmp_path / "dora"
    shutil.copytree(adapters["qv4"], dora)
    peft_config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**peft_config, "use_dora": True}))
    with pytest.raises(LoraLoadError, match="DoRA"):
        load_adapter("dora", dora, config, 16, ALL_MODULES)
    (dora / "adapter_config.json").write_text(json.dumps({**peft_config, "rank_pattern": {"v_proj": 2}}))
    with pytest.raises(LoraLoadError, match=r"'v_proj' sets another rank or alpha for model.layers.0"):
        load_adapter("pattern", dora, config, 16, ALL_MODULES)
    with pytest.raises(ValueError, match="--lora-paths needs --enable-lora"):
        check_lora_flags(EngineConfig(model_path=str(qwen3_ckpt), lora_paths=("a=/x",)))
    with pytest.raises(ValueError, match="one pipeline stage"):
        check_lora_flags(EngineConfig(model_path=str(qwen3_ckpt), enable_lora=True, pp_size=2))
    check_lora_flags(EngineConfig(model_path=str(qwen3_ckpt), enable_lora=True, tp_size=2))  # served


def test_slot_pool_evicts_idle_adapters_only(qwen3_ckpt, adapters):
    config = ModelConfig.from_dir(str(qwen3_ckpt))
    slots = LoraSlots(config, 2, 16, ALL_MODULES, torch.float32, torch.device("cpu"))
    for name, path in adapters.items():
        slots.register(load_adapter(name, path, config, 16, ALL_MODULES))
    first, second = slots.acquire("qv4"), slots.acquire("all8")
    assert {first, second} == {0, 1}
    assert slots.acquire("mlp16") is None  # both slots run requests of other adapters
    assert slots.acquire("qv4") == first  # resident: shared, no copy
    slots.release(first)
    slots.release(first)
    assert slots.acquire("mlp16") == first  # qv4 was idle: evicted
    assert slots.slot_names == (["mlp16", "all8"] if first == 0 else ["all8", "mlp16"])
    projection = slots.projections[(0, "qkv")]
    assert not projection.a[first * projection.width:(first + 1) * projection.width].any()  # mlp16 has no qkv
    slots.hold("all8")
    with pytest.raises(LoraLoadError, match="in use"):
        slots.unregister("all8")
    slots.drop("all8")
    key = slots.cache_key("all8")
    slots.unregister("all8")
    assert slots.names() == ["mlp16", "qv4"]
    # other weights loaded later under the same name never meet the old one's cached pages
    slots.register(load_adapter("all8", adapters["qv4"], config, 16, ALL_MODULES))
    assert slots.cache_key("all8") != key


async def test_tp2_shards_adapters_like_their_base_layers(qwen3_ckpt, adapters, merged_answers):
    """TP 2: q/k/v/gate/up adapters split on B's rows, o/down on A's columns (their partial deltas
    summed by the base layers' all-reduce) give HF's merged tokens, which TP 1 gives too (the test
    above). One adapter is loaded at run time on rank 0 only, and two slots for three adapters make
    slots change hands: the follower copies what rank 0's plan says each slot holds."""
    config = ModelConfig.from_dir(str(qwen3_ckpt))
    names: list[str | None] = [None, *adapters]
    first, *others = adapters
    engine = start_engine(qwen3_ckpt, tp_size=2, enable_lora=True, max_loras_per_batch=2, max_lora_rank=16,
                          lora_paths=tuple(f"{n}={adapters[n]}" for n in others))
    assert engine.lora is not None
    engine.lora.register(load_adapter(first, adapters[first], config, 16, ALL_MODULES))
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)

    async def run(name: str | None, index: int) -> list[int]:
        outputs = [o async for o in generate(engine, PROMPTS[index], params, f"tp-{name}-{index}", lora=name)]
        return [o.token_id for o in outputs]

    try:
        got = await asyncio.gather(*(run(name, i) for name in names for i in range(len(PROMPTS))))
        assert got == [merged_answers[name][i] for name in names for i in range(len(PROMPTS))]
        assert engine.stats().used_pages == 0
    finally:
        engine.shutdown()
