"""HF transformers' greedy tokens, the reference the e2e tests compare workers with.

Many tests ask for the same model and prompts (the TP, PP, DP attention and MoE/MLA suites serve
the same few checkpoints with the same prompt sets), so each model is loaded once and each prompt's
answer computed once per test session.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


@functools.cache
def _model(model_dir: str) -> AutoModelForCausalLM:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # the requests run with ignore_eos
    return model


@functools.cache
def _greedy(model_dir: str, prompt: tuple[int, ...], new_tokens: int) -> tuple[int, ...]:
    with torch.inference_mode():
        out = _model(model_dir).generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                         pad_token_id=0)
    return tuple(out[0, len(prompt):].tolist())


def hf_greedy(model_dir: str | Path, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[list[int]]:
    """HF's greedy continuation of each prompt, `new_tokens` long, in fp32."""
    return [list(_greedy(str(model_dir), tuple(prompt), new_tokens)) for prompt in prompts]
