"""The Qwen3-4B-shaped preset: Qwen3-4B's published dimensions, and sharded writing that draws the
same weights as one file (the preset is written only on a GPU machine; here its shapes come from a
model built on `meta`, and sharding is checked on the tiny preset)."""

from __future__ import annotations

import json
import math

import torch
from safetensors.torch import load_file

from tools.models.tiny_model import (
    PRESETS,
    _parameter_shapes,
    _save_weights,
    _shards,
    model_config,
    write_tiny_model,
)


def test_qwen3_4b_shape_has_qwen3_4b_dimensions(tmp_path):
    config = model_config(PRESETS["qwen3-4b-shape"])
    # Qwen/Qwen3-4B config.json
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
                                   "tie_word_embeddings", "rope_theta", "max_position_embeddings",
                                   "torch_dtype")} == {
        "hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 9728, "vocab_size": 151936, "tie_word_embeddings": True,
        "rope_theta": 1_000_000.0, "max_position_embeddings": 40960, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shapes = _parameter_shapes(tmp_path)
    parameters = sum(math.prod(shape) for shape, _ in shapes.values())
    assert 4.0e9 < parameters < 4.05e9  # "4.0B" on the model card
    runs = _shards(shapes, 2, PRESETS["qwen3-4b-shape"].shard_bytes)
    assert len(runs) == 4 and sorted(sum(runs, [])) == sorted(shapes)


def test_sharded_weights_equal_one_file(tmp_path):
    whole = write_tiny_model(tmp_path / "whole", preset="tiny", seed=3)
    shapes = _parameter_shapes(whole)
    _save_weights(tmp_path, shapes, 0.3, 3, torch.float32, 1 << 20, "qwen3", False)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    sharded = {}
    for file in files:
        sharded.update(load_file(tmp_path / file))
    expected = load_file(whole / "model.safetensors")
    assert sharded.keys() == expected.keys() == index["weight_map"].keys()
    assert all(torch.equal(sharded[name], expected[name]) for name in expected)
