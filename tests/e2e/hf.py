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
from transformers import AutoModelForCausalLM, LogitsProcessorList


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


def hf_generate(model_dir: str | Path, prompt: Sequence[int], new_tokens: int, processors: Sequence,
                eos_token_id: int | None = None) -> list[int]:
    """HF's greedy continuation of `prompt` with `processors` (transformers LogitsProcessor objects)
    applied to the logits, in fp32; it stops at `eos_token_id` if given. It runs on one thread: the
    workers under test hold the cores, and a second pool of spinning threads beside them made 16
    tokens of the tiny preset take 10 s instead of 0.5."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            out = _model(str(model_dir)).generate(torch.tensor([list(prompt)]), max_new_tokens=new_tokens,
                                                  do_sample=False, pad_token_id=0, eos_token_id=eos_token_id,
                                                  logits_processor=LogitsProcessorList(processors))
    finally:
        torch.set_num_threads(threads)
    return out[0, len(prompt):].tolist()
