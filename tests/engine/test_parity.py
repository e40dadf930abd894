"""Greedy output and logprobs of the engine equal HF transformers `generate`, token for token.

Both checkpoints (Qwen3 tiny preset; a Llama with head_dim 48, GQA 4:1, untied embeddings and
llama3 rope scaling) are run with 16 prompts of 1..600 tokens submitted together, so decode
batches and prefill chunks mix, with chunked_prefill_size 64 (a 600-token prompt spans 10 steps).
The second run has a page budget so small that requests must be retracted and recomputed. The
engine runs its fused C++ CPU kernels (kernels/csrc) by default; the first test runs them once per
instruction-set variant the CPU executes (kernels.cpu_ext), and also the torch ops they replace.
HF generates each prompt alone (no padding) with eos disabled, matching the engine's ignore_eos.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.sampling import SamplingParams
from kernels import cpu_ext
from pdserve import envs
from tests.engine.conftest import generate, random_prompts, start_engine

LENGTHS = [1, 2, 3, 7, 15, 16, 17, 31, 33, 64, 65, 100, 129, 250, 400, 600]
NEW_TOKENS = 20
# fp32 both sides; measured differences are about 1e-5 (different matmul orders and fused norms).
LOGPROB_TOLERANCE = 1e-3


def hf_reference(model_dir, prompts: list[list[int]],
                 device: str = "cpu") -> list[tuple[list[int], list[float]]]:
    """HF's greedy tokens and logprobs in fp32 on `device` (tests/gpu runs it on CUDA)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    model.generation_config.eos_token_id = None  # the engine runs with ignore_eos
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt], device=device), max_new_tokens=NEW_TOKENS,
                                 do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0)
            tokens = out.sequences[0, len(prompt):].tolist()
            logprobs = [torch.log_softmax(step[0].float(), -1)[t].item()
                        for step, t in zip(out.logits, tokens, strict=True)]
            results.append((tokens, logprobs))
    return results


async def engine_outputs(engine, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)

    async def one(index: int, prompt: list[int]):
        tokens, logprobs = [], []
        async for output in generate(engine, prompt, params, f"p{index}"):
            tokens.append(output.token_id)
            logprobs.append(output.logprob)
            last = output
        assert last.finish_reason == "length"
        return tokens, logprobs

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def case(request):
    model_dir = request.getfixturevalue(f"{request.param}_ckpt")
    prompts = random_prompts(LENGTHS, seed=7)
    return model_dir, prompts, hf_reference(model_dir, prompts)


def check_equal(got, expected) -> None:
    for length, (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(LENGTHS, got, expected, strict=True):
        assert tokens == ref_tokens, f"prompt of {length} tokens"
        worst = max(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True))
        assert worst < LOGPROB_TOLERANCE, f"prompt of {length} tokens: logprob off by {worst}"


# The fused C++ kernels, once per variant this CPU runs (avx512, avx2), and the torch ops.
@pytest.mark.parametrize("kernels", [*(f"on:{v.name}" for v in cpu_ext.executable_isas()), "off"])
async def test_greedy_matches_hf_with_chunked_prefill(case, kernels, monkeypatch):
    model_dir, prompts, expected = case
    cpu_kernels, _, isa = kernels.partition(":")
    if isa:
        monkeypatch.setenv(envs.CPU_ISA.name, isa)
    engine = start_engine(model_dir, chunked_prefill_size=64, num_pages=512, cpu_kernels=cpu_kernels)
    try:
        got = await engine_outputs(engine, prompts)
        stats = engine.stats()
    finally:
        engine.shutdown()
    check_equal(got, expected)
    assert stats.total_retractions == 0
    assert stats.used_pages == 0 and stats.running == 0 and stats.waiting == 0


async def test_greedy_matches_hf_under_retraction(case):
    model_dir, prompts, expected = case
    # 160 pages of 4 tokens: the 600-token prompt plus its output needs 155 of them, so decodes
    # that cross a page boundary keep running out of pages and retract the newest request.
    engine = start_engine(model_dir, chunked_prefill_size=64, page_size=4, num_pages=160)
    try:
        got = await engine_outputs(engine, prompts)
        stats = engine.stats()
    finally:
        engine.shutdown()
    check_equal(got, expected)
    assert stats.total_retractions > 0
    assert stats.used_pages == 0
