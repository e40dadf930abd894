"""The built-in checkpoint: deterministic bytes, loads with transformers offline, usable output."""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tools.models.tiny_model import write_tiny_model

REPO = Path(__file__).resolve().parents[3]


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", preset="tiny", seed=0)


def test_same_flags_same_bytes_across_processes(tiny_dir, tmp_path):
    # The second copy is written by the CLI in a fresh process with one tokenizer thread: Rust hash
    # maps in the trainer are seeded per process and its work is split over threads, so this also
    # checks that training depends on neither (a machine with more cores gets the same tokenizer).
    other = tmp_path / "again"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAYON_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "pdserve", "make-tiny-model", "--out", str(other), "--seed", "0"],
                   cwd=REPO, env=env, check=True, capture_output=True, timeout=120)
    expected = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", "chat_template.jinja"}
    assert set(_digests(tiny_dir)) == expected
    assert _digests(other) == _digests(tiny_dir)


def test_other_seed_other_weights(tiny_dir, tmp_path):
    other = write_tiny_model(tmp_path / "seed1", preset="tiny", seed=1)
    assert _digests(other)["model.safetensors"] != _digests(tiny_dir)["model.safetensors"]


def test_config_matches_preset(tiny_dir):
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["intermediate_size"],
            config["vocab_size"]) == (256, 4, 4, 2, 64, 768, 4096)
    assert config["tie_word_embeddings"] is True
    hf_config = AutoConfig.from_pretrained(tiny_dir)
    assert hf_config.rope_parameters["rope_theta"] == 1_000_000.0
    assert hf_config.max_position_embeddings == 4096 and hf_config.rms_norm_eps == 1e-6


def test_tokenizer_special_tokens_and_chat_template(tiny_dir):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert len(tok) == 4096
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert ids == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    assert tok.eos_token == "<|im_end|>"
    assert tok.encode("<|im_start|>user")[0] == 1
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, 0]

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi, 世界 😀"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHi, 世界 😀<|im_end|>\n<|im_start|>assistant\n")
    encoded = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert tok.decode(encoded["input_ids"]) == text

    sample = "def f(x):\n    return x ** 2  # Ünïcödé, 今日は, 🚀🇯🇵"
    assert tok.decode(tok.encode(sample)) == sample


def test_loads_and_greedy_output_varies(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    files = load_file(str(tiny_dir / "model.safetensors"))
    state = model.state_dict()
    assert set(files) == set(state) - {"lm_head.weight"}
    assert all(torch.equal(files[name], state[name]) for name in files)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    gaps = []
    for prompt in ("Hello, my name is", "def compute(x):", "In 1999, the server"):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
        new_tokens = out.sequences[0, ids.shape[1]:].tolist()
        assert len(set(new_tokens)) >= 12, f"greedy output of {prompt!r} repeats: {new_tokens}"
        gaps += [float(s[0].topk(2).values.diff().neg()) for s in out.scores]
    # Large top-1/top-2 gaps are what lets engine tests compare greedy tokens with HF exactly.
    assert statistics.median(gaps) > 0.5


def test_llama_variant_with_overrides(tmp_path):
    folder = write_tiny_model(tmp_path / "llama", preset="tiny", arch="llama", head_dim=32,
                              num_key_value_heads=1, tie_word_embeddings=False, tokenizer_vocab_size=1024)
    config = AutoConfig.from_pretrained(folder)
    assert config.model_type == "llama" and config.head_dim == 32 and config.num_key_value_heads == 1
    assert config.vocab_size == 4096
    assert len(AutoTokenizer.from_pretrained(folder)) == 1024
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    files = load_file(str(folder / "model.safetensors"))
    assert files["lm_head.weight"].shape == (4096, 256)
    assert files["model.layers.0.self_attn.k_proj.weight"].shape == (32, 256)
    assert not torch.equal(files["lm_head.weight"], files["model.embed_tokens.weight"])


def test_rejects_unknown_preset_and_arch(tmp_path):
    with pytest.raises(ValueError, match="preset"):
        write_tiny_model(tmp_path / "x", preset="huge")
    with pytest.raises(ValueError, match="arch"):
        write_tiny_model(tmp_path / "y", arch="gpt2")
