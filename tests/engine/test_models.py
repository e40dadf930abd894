"""Config parsing, rotary scaling and the decoder's logits against HF forward passes."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config, Qwen2ForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.model_runner import ModelRunner
from engine.models.config import ModelConfig, resolve_dtype
from engine.models.decoder import DecoderModel
from engine.models.rope import inverse_frequencies
from engine.scheduler import ScheduledChunk, SchedulerOutput
from libkv.layout import KVLayout
from libkv.pool import KVPool

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)


def test_config_old_and_new_rope_formats(tmp_path):
    old = {**BASE, "architectures": ["LlamaForCausalLM"], "rope_theta": 500000.0, "eos_token_id": 5,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
           "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(old))
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.rope.rope_type == "llama3" and cfg.rope.theta == 500000.0 and cfg.rope.factor == 8.0
    assert cfg.head_dim == 16 and cfg.eos_token_ids == (5,) and not cfg.qk_norm and not cfg.qkv_bias
    assert resolve_dtype("auto", cfg) == torch.bfloat16 and resolve_dtype("float32", cfg) == torch.float32
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (7, 8)

    new = {**BASE, "model_type": "qwen3", "head_dim": 32, "dtype": "float32",
           "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    cfg = ModelConfig.from_dict(new)
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.qk_norm and cfg.head_dim == 32
    assert cfg.rope.theta == 1e6 and cfg.rope.rope_type == "default"
    assert ModelConfig.from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"]}).qkv_bias

    with pytest.raises(ValueError, match="unsupported model"):
        ModelConfig.from_dict({**BASE, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="rope type"):
        ModelConfig.from_dict({**BASE, "model_type": "llama",
                               "rope_scaling": {"rope_type": "yarn", "factor": 2}})


@pytest.mark.parametrize("rope_scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_inverse_frequencies_match_transformers(rope_scaling):
    hf_config = LlamaConfig(**{**BASE, "max_position_embeddings": 8192}, head_dim=48, rope_theta=10000.0,
                            rope_scaling=rope_scaling)
    raw = json.loads(hf_config.to_json_string())
    ours = inverse_frequencies(ModelConfig.from_dict(raw).rope, 48)
    kind = rope_scaling["rope_type"] if rope_scaling else None
    if kind is None:
        expected = 1.0 / (10000.0 ** (torch.arange(0, 48, 2, dtype=torch.int64).float() / 48))
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[kind](hf_config, torch.device("cpu"))
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


def run_chunks(model_dir, dtype: torch.dtype, ids: list[int], cuts: list[int]) -> torch.Tensor:
    """Logits at the last token of each piece of `ids` cut at `cuts`, fed as consecutive chunks
    (the final piece of one token goes through the decode path)."""
    cfg = ModelConfig.from_dir(model_dir)
    model = DecoderModel.load(str(model_dir), cfg, dtype, torch.device("cpu"))
    pool = KVPool(KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4, str(dtype)[6:]), 128)
    runner = ModelRunner(model, pool)
    pages = torch.randperm(128, generator=torch.Generator().manual_seed(0)).tolist()  # scattered pages
    rows, start = [], 0
    for end in [*cuts, len(ids)]:
        chunk = ScheduledChunk("r", ids[start:end], start, pages, True)
        is_decode = end - start == 1 and start > 0
        batch = SchedulerOutput(decodes=[chunk]) if is_decode else SchedulerOutput(extends=[chunk])
        rows.append(runner.forward(batch)[0])
        start = end
    return torch.stack(rows)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = Qwen2Config(**BASE, initializer_range=0.2, tie_word_embeddings=True, rope_theta=10000.0,
                         use_sliding_window=False)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # random biases: zero ones would not test that they are loaded
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    out = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(out, max_shard_size="100KB")  # sharded: model.safetensors.index.json
    return out, model


def test_qwen2_bias_sharded_checkpoint_matches_hf(qwen2_dir):
    model_dir, hf = qwen2_dir
    assert (model_dir / "model.safetensors.index.json").exists()
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    cuts = [13, 30, 39]
    ours = run_chunks(model_dir, torch.float32, ids, cuts)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, [c - 1 for c in cuts] + [39]]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_llama_and_qwen3_checkpoints_match_hf(qwen3_ckpt, llama_ckpt):
    from transformers import AutoModelForCausalLM

    ids = torch.randint(10, 4000, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    cuts = [1, 100, 299]
    for model_dir in (qwen3_ckpt, llama_ckpt):
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, [c - 1 for c in cuts] + [299]]
        # Logits reach about 20 here; oneDNN's packed fp32 products sum in another order than HF's
        # (2.5e-4 at most measured, 1.2e-4 with F.linear), where bf16 rounding would give about 1e-1.
        torch.testing.assert_close(run_chunks(model_dir, torch.float32, ids, cuts), ref, rtol=1e-4, atol=5e-4)


def test_bfloat16_runs_close_to_float32(qwen3_ckpt):
    ids = torch.randint(10, 4000, (50,), generator=torch.Generator().manual_seed(3)).tolist()
    full = run_chunks(qwen3_ckpt, torch.float32, ids, [20, 49])
    half = run_chunks(qwen3_ckpt, torch.bfloat16, ids, [20, 49])
    assert half.dtype == torch.float32  # logits always come back in fp32
    similarity = torch.nn.functional.cosine_similarity(full, half, dim=-1)
    assert (similarity > 0.99).all(), similarity
