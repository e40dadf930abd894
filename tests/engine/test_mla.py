"""DeepSeek's multi-head latent attention: greedy tokens and logprobs of the engine equal HF
transformers `generate`, token for token (fp32), on tiny random DeepSeek checkpoints.

Three checkpoints cover every switch of the attention: V3 with q_lora_rank and interleaved yarn
rope (an attention factor != 1 and a softmax mscale); V3 without q_lora_rank, rotate-half rope,
attention biases and other dims; V2 (complex fp32 rope, yarn). All MLPs are dense
(first_k_dense_replace = num_hidden_layers), so only the attention differs from the Llama path.
Prompts of 1..300 tokens run together with chunks of 32, so decode rows and extend spans with a
cached prefix share steps. The prefix cache, retraction, TP 2, bf16 (teacher-forced), batch
invariance and a PD-style page copy are checked on the first (TP 2 on the second too).

Measured (2026-11-25): fp32 logprobs within 1.4e-4 of HF on every case, TP 2 included; bf16 within
0.25 of HF bf16 (v3; 0.20 for v2 and v3-noq), while HF bf16 is itself up to 0.9 from HF fp32.

The helpers (`write_tiny_deepseek`, `hf_reference`, `engine_outputs`, `check_equal`) take a
checkpoint folder, so a checkpoint with routed experts can reuse them.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from engine.models.config import ModelConfig
from engine.models.rope import inverse_frequencies, mla_softmax_scale
from engine.sampling import SamplingParams
from engine.tp.shard import UnshardableModel, check_tp_size
from tests.engine.conftest import generate, random_prompts, start_engine
from tools.models.tiny_model import _parameter_shapes, random_weights
from tools.models.tokenizer_train import ENDOFTEXT, IM_END, special_token_ids, write_tokenizer

LENGTHS = [1, 2, 15, 16, 17, 40, 129, 300]
NEW_TOKENS = 16
LOGPROB_TOLERANCE = 1e-3  # fp32 both sides; measured at most 1.1e-4
# bf16 against HF bf16, teacher-forced: measured at most 0.25 (HF bf16 itself is up to 0.9 from HF
# fp32 on these tokens; engine.models.mla says where the roundings differ).
BF16_TOLERANCE = 0.5

_ARCHS = {"deepseek_v2": ("DeepseekV2ForCausalLM", "DeepseekV2Config"),
          "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config")}

# Each case: (model_type, config overrides).
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "v3": ("deepseek_v3", dict(
        q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=48,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}, max_position_embeddings=512)),
    "v3-noq": ("deepseek_v3", dict(
        num_attention_heads=8, q_lora_rank=None, kv_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=24, rope_interleave=False, attention_bias=True, rope_theta=50000.0)),
    "v2": ("deepseek_v2", dict(
        q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=16, v_head_dim=32,
        rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
        max_position_embeddings=1024)),
}


def deepseek_config(model_type: str, **overrides: Any) -> dict[str, Any]:
    """config.json of a tiny dense DeepSeek, in the layout DeepSeek ships (rope_theta and
    rope_scaling at top level)."""
    ids = special_token_ids()
    layers = overrides.pop("num_hidden_layers", 3)
    config: dict[str, Any] = {
        "architectures": [_ARCHS[model_type][0]], "model_type": model_type,
        "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": overrides.get("num_attention_heads", 4),
        "first_k_dense_replace": layers, "moe_intermediate_size": 64, "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
        "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "rope_scaling": None, "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "float32",
        "initializer_range": 0.3, "bos_token_id": ids[ENDOFTEXT], "eos_token_id": ids[IM_END],
    }
    config.update(overrides)
    return config


def write_tiny_deepseek(out_dir: str | Path, model_type: str = "deepseek_v3", seed: int = 0,
                        **overrides: Any) -> Path:
    """A random-weight DeepSeek checkpoint folder (config, safetensors, tokenizer), as
    tools.models.tiny_model writes its presets: uniform weights of std 0.3 so that greedy argmaxes
    have wide gaps; biases random too (so attention_bias is exercised), norms ones."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = deepseek_config(model_type, **overrides)
    write_tokenizer(out, vocab_size=config["vocab_size"], corpus_bytes=1_000_000, seed=seed)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": config["eos_token_id"]}) + "\n")
    shapes = _parameter_shapes(out)
    weights = random_weights(shapes, std=config["initializer_range"], seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    for name in sorted(weights):
        if name.endswith(".bias"):
            weights[name] = (torch.rand(weights[name].shape, generator=generator) - 0.5) * 0.6
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def hf_reference(model_dir, prompts: list[list[int]], new_tokens: int = NEW_TOKENS):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # the engine runs with ignore_eos
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0)
            tokens = out.sequences[0, len(prompt):].tolist()
            logprobs = [torch.log_softmax(step[0].float(), -1)[t].item()
                        for step, t in zip(out.logits, tokens, strict=True)]
            results.append((tokens, logprobs))
    return results


async def engine_outputs(engine, prompts: list[list[int]], new_tokens: int = NEW_TOKENS):
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True, logprobs=True)

    async def one(index: int, prompt: list[int]):
        outputs = [o async for o in generate(engine, prompt, params, f"m{index}")]
        assert outputs[-1].finish_reason == "length"
        return [o.token_id for o in outputs], [o.logprob for o in outputs]

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def check_equal(got, expected, what: str, tolerance: float = LOGPROB_TOLERANCE) -> float:
    """Tokens equal, logprobs within `tolerance`; returns the largest logprob difference."""
    worst = 0.0
    for index, ((tokens, logprobs), (ref_tokens, ref_logprobs)) in enumerate(zip(got, expected, strict=True)):
        assert tokens == ref_tokens, f"{what}: prompt {index}"
        worst = max(worst, *(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True)))
    assert worst < tolerance, f"{what}: logprob off by {worst}"
    return worst


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> (checkpoint folder, prompts, HF's greedy outputs), each written on first use."""
    cache: dict[str, tuple[Path, list[list[int]], list]] = {}

    def get(name: str):
        if name not in cache:
            model_type, overrides = CASES[name]
            model_dir = write_tiny_deepseek(tmp_path_factory.mktemp("mla") / name, model_type, seed=3,
                                            **overrides)
            prompts = random_prompts(LENGTHS, seed=9)
            cache[name] = model_dir, prompts, hf_reference(model_dir, prompts)
        return cache[name]

    return get


@pytest.mark.parametrize("name", sorted(CASES))
async def test_greedy_matches_hf_with_chunked_prefill(built, name):
    model_dir, prompts, expected = built(name)
    engine = start_engine(model_dir, chunked_prefill_size=32, num_pages=256)
    try:
        got = await engine_outputs(engine, prompts)
        stats = engine.stats()
    finally:
        engine.shutdown()
    worst = check_equal(got, expected, name)
    print(f"{name}: fp32 max logprob difference vs HF {worst:.2e}")
    assert stats.used_pages == 0 and stats.total_retractions == 0


async def test_greedy_matches_hf_under_retraction(built):
    model_dir, prompts, expected = built("v3")
    # 80 pages of 4 tokens: the 300-token prompt and its output need 79, so decodes crossing a
    # page boundary run out of pages and retract requests, whose tokens are recomputed as prompts.
    engine = start_engine(model_dir, chunked_prefill_size=32, page_size=4, num_pages=80)
    try:
        got = await engine_outputs(engine, prompts)
        stats = engine.stats()
    finally:
        engine.shutdown()
    check_equal(got, expected, "v3 under retraction")
    assert stats.total_retractions > 0 and stats.used_pages == 0


async def test_prefix_cache_hits_match_hf(built):
    model_dir, _, _ = built("v3")
    base = random_prompts([53], seed=21)[0]
    tails = random_prompts([7] * 6, seed=22)
    # Prefixes around the 16-token page boundaries, then the base again (fully cached).
    prompts = ([base] + [base[:n] + tail for n, tail in zip([1, 15, 16, 17, 32, 48], tails, strict=True)]
               + [base])
    expected = hf_reference(model_dir, prompts, new_tokens=8)
    engine = start_engine(model_dir, chunked_prefill_size=32, num_pages=64, page_size=16)
    try:
        got = [(await engine_outputs(engine, [p], new_tokens=8))[0] for p in prompts]
        together = await engine_outputs(engine, prompts, new_tokens=8)
        stats = engine.stats()
    finally:
        engine.shutdown()
    check_equal(got, expected, "v3 one at a time, prefix cache on")
    check_equal(together, expected, "v3 together, prefix cache on")
    assert stats.prefix_hit_tokens > 0 and stats.used_pages == 0


@pytest.mark.parametrize("name", ["v3", "v3-noq"])  # q_a/q_b and q_proj; o_proj bias added once
async def test_tensor_parallel_matches_hf(built, name):
    model_dir, prompts, expected = built(name)
    engine = start_engine(model_dir, chunked_prefill_size=32, num_pages=256, tp_size=2)
    try:
        got = await engine_outputs(engine, prompts)
        stats = engine.stats()
    finally:
        engine.shutdown()
    worst = check_equal(got, expected, f"{name} TP 2")
    print(f"{name} TP 2: fp32 max logprob difference vs HF {worst:.2e}")
    assert stats.used_pages == 0


def test_config_reads_deepseek_shapes_and_yarn():
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # DeepSeek-V3's own rope_scaling, on a small head.
    raw = deepseek_config("deepseek_v3", q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32,
                          qk_rope_head_dim=16,
                          v_head_dim=48, max_position_embeddings=163840,
                          rope_scaling={"type": "yarn", "factor": 40,
                                        "original_max_position_embeddings": 4096,
                                        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                        "mscale_all_dim": 1.0})
    config = ModelConfig.from_dict(raw)
    assert config.mla is not None and config.mla.q_lora_rank == 96 and config.mla.rope_style == "interleave"
    assert (config.num_kv_heads, config.head_dim) == (4, 48)
    hf = DeepseekV3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    assert torch.equal(inverse_frequencies(config.rope, 16), inv_freq)
    assert config.rope.attention_factor == attention_factor
    mscale = 0.1 * math.log(40) + 1.0
    assert mla_softmax_scale(config.rope, 48) == 48 ** -0.5 * mscale * mscale
    assert ModelConfig.from_dict(deepseek_config("deepseek_v2")).mla.rope_style == "complex"
    # MLA splits only query heads over TP ranks: 4 heads divide 2 ways, not 3.
    check_tp_size(2, config)
    with pytest.raises(UnshardableModel, match="does not divide the model's 4 attention heads"):
        check_tp_size(3, config)
    config = ModelConfig.from_dict(deepseek_config("deepseek_v3", rope_interleave=False))
    assert config.mla.rope_style == "half"


async def test_bf16_logprobs_match_hf_teacher_forced(built):
    # As tests/engine/test_parity_bf16.py: bf16 runs drift apart on near ties, so HF scores the
    # engine's own output in one forward pass; the engine's logprob of each token must be HF bf16's
    # to BF16_TOLERANCE, and its token greedy under HF to the same tolerance. HF fp32 scores them
    # too: the engine's bf16 error is no larger than HF bf16's own.
    from transformers import AutoModelForCausalLM

    model_dir, prompts, _ = built("v3")
    engine = start_engine(model_dir, dtype="bfloat16", chunked_prefill_size=32, num_pages=256)
    try:
        outputs = await engine_outputs(engine, prompts)
    finally:
        engine.shutdown()
    models = {dtype: AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
              for dtype in (torch.bfloat16, torch.float32)}
    worst = regret = engine_error = hf_error = 0.0
    for prompt, (tokens, logprobs) in zip(prompts, outputs, strict=True):
        chosen = {}
        for dtype, model in models.items():
            with torch.inference_mode():
                logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
            reference = torch.log_softmax(logits, dim=-1)
            chosen[dtype] = reference.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
            if dtype == torch.bfloat16:
                regret = max(regret, (reference.max(dim=-1).values - chosen[dtype]).max().item())
        ours = torch.tensor(logprobs)
        worst = max(worst, (chosen[torch.bfloat16] - ours).abs().max().item())
        engine_error = max(engine_error, (chosen[torch.float32] - ours).abs().max().item())
        hf_error = max(hf_error, (chosen[torch.float32] - chosen[torch.bfloat16]).abs().max().item())
    print(f"v3 bf16: max logprob difference vs HF bf16 {worst:.3f} (regret {regret:.3f}); vs HF fp32: "
          f"engine {engine_error:.3f}, HF bf16 {hf_error:.3f}")
    assert worst < BF16_TOLERANCE and regret < BF16_TOLERANCE
    assert engine_error < hf_error + 0.1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_alone_equals_in_a_batch_and_pd_equals_colocated(built, dtype):
    """Bit-identical outputs for a request decoded alone, in a batch, and prefilled on one engine
    then decoded on another from the copied pages (what PD does)."""
    from kernels import ops
    from tests.engine.conftest import prefill_first_token

    model_dir, _, _ = built("v3")
    greedy = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=2)
    target, *others = random_prompts([150, 1, 40, 90, 3], seed=5)

    async def run(engine, prompt, room, **kind):
        return [(o.token_id, o.logprob, tuple(o.top_logprobs))
                async for o in generate(engine, prompt, greedy, room, **kind)]

    kwargs = dict(dtype=dtype, chunked_prefill_size=256, num_pages=128, disable_radix_cache=True)
    engine, decode = start_engine(model_dir, **kwargs), start_engine(model_dir, **kwargs)
    try:
        alone = await run(engine, target, "alone")
        together = await asyncio.gather(run(engine, target, "target"),
                                        *(run(engine, p, f"other{i}") for i, p in enumerate(others)))
        assert together[0] == alone
        assert decode.reserve("spacer", 40) is not None  # page ids differ between the two engines
        reservation = decode.reserve_prompt("pd", target)
        written: list[int] = []
        first = await prefill_first_token(engine, target, greedy, "pd",
                                          lambda page_ids, _: written.__setitem__(slice(None), page_ids))
        ops.scatter_pages(decode.pool.buffer, reservation.tail, ops.gather_pages(engine.pool.buffer, written))
        assert engine.release("pd")
        assert await run(decode, target, "pd", first_token=first) == alone
        assert decode.release("spacer")
    finally:
        engine.shutdown()
        decode.shutdown()


def test_misshapen_mla_tensor_is_refused_naming_it(built, tmp_path):
    import shutil

    from safetensors.torch import load_file

    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.models.weights import MisshapenTensor

    model_dir, _, _ = built("v3")
    broken = Path(shutil.copytree(model_dir, tmp_path / "broken"))
    weights = load_file(str(broken / "model.safetensors"))
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    weights[name] = weights[name][:, :-1].contiguous()
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(MisshapenTensor, match=name.replace(".", r"\.")):
        Engine.load(EngineConfig(model_path=str(broken), num_pages=16))
