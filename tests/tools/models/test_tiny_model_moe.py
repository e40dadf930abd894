"""The mixture-of-experts presets: published per-expert layout that transformers loads as its own,
DeepSeek's correction bias and group limit doing something, small-moe's size, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from engine.models.moe import Router
from engine.models.moe_config import MoEConfig
from tools.models.tiny_model import PRESETS, _parameter_shapes, model_config, write_tiny_model

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("ds") / "model", preset="tiny-deepseek", seed=0)


def _loads_as_written(folder: Path):
    """The HF model of `folder`, after checking it found every tensor, and each per-expert tensor
    equals its slice of HF's fused in-memory one."""
    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    # transformers ignores DeepSeek-V3's MTP layer, stored after the last one (engine.models.mtp)
    mtp = f"model.layers.{model.config.num_hidden_layers}."
    unexpected = {name for name in info.pop("unexpected_keys") if not name.startswith(mtp)}
    assert not unexpected and not any(info.values()), (unexpected, info)
    files = load_file(str(folder / "model.safetensors"))
    state = model.state_dict()
    for name, tensor in files.items():
        if name.startswith(mtp):
            continue
        if ".experts." in name and ".shared_experts." not in name:
            layer, expert, proj = name.split(".mlp.experts.")[0], int(name.split(".")[5]), name.split(".")[6]
            width = tensor.shape[1] if proj == "down_proj" else tensor.shape[0]
            fused_name = "down_proj" if proj == "down_proj" else "gate_up_proj"
            fused = state[f"{layer}.mlp.experts.{fused_name}"][expert]
            part = {"gate_proj": fused[:width], "up_proj": fused[width:], "down_proj": fused}[proj]
            assert torch.equal(tensor, part), name
        else:
            assert torch.equal(tensor, state[name]), name
    return model, files


def test_tiny_moe_is_a_published_qwen3_moe_checkpoint(tmp_path):
    folder = write_tiny_model(tmp_path / "moe", preset="tiny-moe", seed=0)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    experts = (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"])
    assert experts == (8, 2, 256)
    model, files = _loads_as_written(folder)
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in files
    assert "model.layers.1.mlp.gate_proj.weight" in files  # the dense layer
    assert not any(".experts.gate_up_proj" in name for name in files)


def test_mixtral_variant_uses_mixtral_names(tmp_path):
    folder = write_tiny_model(tmp_path / "mixtral", preset="tiny-moe", arch="mixtral", num_local_experts=4,
                              intermediate_size=64, tokenizer_vocab_size=512)
    files = load_file(str(folder / "model.safetensors"))
    assert files["model.layers.3.block_sparse_moe.experts.3.w2.weight"].shape == (256, 64)
    assert files["model.layers.3.block_sparse_moe.gate.weight"].shape == (4, 256)
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert type(model).__name__ == "MixtralForCausalLM" and not any(info.values())


def test_tiny_deepseek_loads_in_transformers(deepseek_dir):
    config = AutoConfig.from_pretrained(deepseek_dir)
    assert config.model_type == "deepseek_v3" and config.first_k_dense_replace == 1
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_rope_head_dim, config.qk_nope_head_dim,
            config.v_head_dim) == (128, 128, 32, 64, 64)
    model, files = _loads_as_written(deepseek_dir)
    assert files["model.layers.1.mlp.shared_experts.up_proj.weight"].shape == (256, 256)
    assert "model.layers.0.mlp.gate_proj.weight" in files and "model.layers.0.mlp.gate.weight" not in files
    bias = files["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.shape == (8,) and bias.std() > 0.1


def test_deepseek_group_limit_and_bias_change_choices(deepseek_dir):
    """With the preset's router weights and random normed inputs, the correction bias and the
    group limit each change some tokens' experts (else a test could not tell them from plain top-k)."""
    files = load_file(str(deepseek_dir / "model.safetensors"))
    weight = files["model.layers.2.mlp.gate.weight"]
    bias = files["model.layers.2.mlp.gate.e_score_correction_bias"]
    moe = MoEConfig.from_dict(json.loads((deepseek_dir / "config.json").read_text()), "DeepseekV3ForCausalLM")
    x = torch.randn(1000, 256, generator=torch.Generator().manual_seed(0))
    ids = Router(moe, weight, bias)(x)[0].sort(-1)[0]
    scores = (x @ weight.T).sigmoid()
    ungrouped = (scores + bias).topk(2, dim=-1)[1].sort(-1)[0]
    unbiased = scores.topk(2, dim=-1)[1].sort(-1)[0]
    grouped_changed = (ids != ungrouped).any(-1).float().mean()
    bias_changed = (ungrouped != unbiased).any(-1).float().mean()
    assert 0.05 < grouped_changed < 0.95 and 0.05 < bias_changed < 0.95


def test_deepseek_without_q_lora(tmp_path):
    folder = write_tiny_model(tmp_path / "noq", preset="tiny-deepseek", q_lora_rank=None,
                              tokenizer_vocab_size=512)
    _, files = _loads_as_written(folder)
    assert files["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 96, 256)


def test_small_moe_size(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(model_config(PRESETS["small-moe"])))
    shapes = _parameter_shapes(tmp_path)
    total = sum(torch.Size(shape).numel() for shape, _ in shapes.values())
    assert 140e6 < total < 160e6  # about 612 MB in fp32
    assert shapes["model.layers.11.mlp.experts.gate_up_proj"][0] == (16, 384, 768)


def test_cli_help_lists_the_presets():
    out = subprocess.run([sys.executable, "-m", "pdserve", "make-tiny-model", "--help"], cwd=REPO,
                         check=True, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"},
                         timeout=60).stdout
    for preset in ("tiny-moe", "small-moe", "tiny-deepseek"):
        assert preset in out
