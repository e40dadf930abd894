"""The always-agreeing target/draft pair (tools.models.agreeing_draft): the draft keeps the target's
first layers and the target's later layers add exactly nothing, so both give the same greedy tokens
(checked with HF transformers), while the target still runs every layer."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tools.models.agreeing_draft import write_pair


def test_the_draft_and_the_target_agree_token_for_token(qwen3_ckpt, tmp_path) -> None:
    layers = json.loads((qwen3_ckpt / "config.json").read_text())["num_hidden_layers"]
    target_dir, draft_dir = write_pair(qwen3_ckpt, 1, tmp_path / "target", tmp_path / "draft")
    assert json.loads((draft_dir / "config.json").read_text())["num_hidden_layers"] == 1
    target, draft = (AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
                     for path in (target_dir, draft_dir))
    prompt = torch.randint(10, 4000, (1, 17), generator=torch.Generator().manual_seed(0))
    outputs = [m.generate(prompt, max_new_tokens=10, do_sample=False, min_new_tokens=10)
               for m in (target, draft)]
    assert torch.equal(outputs[0], outputs[1])
    # the later layers are still in the target (a full step's cost) with their other weights intact;
    # only what they add to the residual stream is zero, and the kept layer is untouched
    original = load_file(str(qwen3_ckpt / "model.safetensors"))
    assert len(target.model.layers) == layers > 1
    late, kept = target.model.layers[layers - 1], target.model.layers[0]
    assert not late.self_attn.o_proj.weight.any() and not late.mlp.down_proj.weight.any()
    assert torch.equal(late.mlp.up_proj.weight, original[f"model.layers.{layers - 1}.mlp.up_proj.weight"])
    assert torch.equal(kept.self_attn.o_proj.weight, original["model.layers.0.self_attn.o_proj.weight"])


def test_a_model_that_is_not_dense_is_refused(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral", "num_hidden_layers": 2}))
    with pytest.raises(SystemExit, match="not one of"):
        write_pair(tmp_path, 1, tmp_path / "t", tmp_path / "d")
