"""Train the built-in byte-level BPE tokenizer and write it as HF tokenizer files.

The pipeline copies Qwen2/Qwen3's (NFC, the Qwen split regex, byte-level BPE, byte-level decoder),
so the engine's tokenizer code sees the same shape of tokenizer.json as a real Qwen checkpoint.
Special tokens take ids 0, 1, 2. Output is deterministic: the corpus comes from a seed and the
`tokenizers` BPE trainer breaks count ties by token ids (checked by a test building twice).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from tools.models.tokenizer_corpus import generate_corpus

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# Same split as Qwen2/Qwen3: single digits, letters with one leading non-letter, punctuation runs.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML, as Qwen's instruct models use it (without tool calling).
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def build_tokenizer(vocab_size: int, corpus_bytes: int, seed: int = 0) -> Tokenizer:
    """Train a byte-level BPE with exactly `vocab_size` entries (special tokens included)."""
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tokenizer.post_processor = None
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = generate_corpus(corpus_bytes, seed=seed, invented_words=2 * vocab_size)
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    got = tokenizer.get_vocab_size()
    if got != vocab_size:
        raise RuntimeError(f"tokenizer training produced {got} tokens, wanted {vocab_size}; "
                           f"raise corpus_bytes (now {corpus_bytes})")
    return tokenizer


def tokenizer_config(model_max_length: int) -> dict:
    """tokenizer_config.json in the shape transformers 5 writes for Qwen3 checkpoints."""
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, tok in enumerate(SPECIAL_TOKENS)
        },
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_tokenizer(out_dir: Path, vocab_size: int, corpus_bytes: int, seed: int = 0,
                    model_max_length: int = 4096) -> Tokenizer:
    """Train and write tokenizer.json, tokenizer_config.json and chat_template.jinja into out_dir."""
    tokenizer = build_tokenizer(vocab_size, corpus_bytes, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=False)
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(model_max_length), indent=2, sort_keys=True) + "\n")
    (out_dir / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    return tokenizer


def special_token_ids() -> dict[str, int]:
    """Ids of the special tokens in every tokenizer written here."""
    return {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
