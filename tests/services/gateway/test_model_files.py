"""ModelFiles.min_tokens is a true lower bound: a prompt it calls too long is too long."""

from __future__ import annotations

import random
from pathlib import Path

from services.gateway.prompts import ModelFiles, _bytes_per_token_bound


def test_min_tokens_never_exceeds_the_real_count(tiny_model: Path) -> None:
    files = ModelFiles(tiny_model)
    rng = random.Random(0)
    alphabet = "ab \n\t한국어각e\u0301\u0323αβγ😀<|im_start|>" + "".join(map(chr, range(32, 127)))
    samples = ["", "x" * 5000, " " * 5000, "<|im_start|>" * 300, "\u1100\u1161\u11a8" * 2000]
    samples += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3000))) for _ in range(200)]
    for text in samples:
        real = len(files.encode(text, add_special_tokens=False))
        assert files.min_tokens(text) <= real, (text[:40], files.min_tokens(text), real)
    assert files.min_tokens("hello world " * 600_000) > files.context_length  # 7.2 MB: refused untokenized


def test_no_bound_for_tokenizers_that_could_swallow_text() -> None:
    bpe = {"model": {"type": "BPE", "vocab": {"abc": 0, "é": 1}}, "normalizer": None, "added_tokens": []}
    assert _bytes_per_token_bound(bpe) == 3
    assert _bytes_per_token_bound({**bpe, "normalizer": {"type": "NFC"}}) == 12
    assert _bytes_per_token_bound({**bpe, "normalizer": {"type": "Replace"}}) is None  # could delete text
    assert _bytes_per_token_bound({**bpe, "model": {**bpe["model"], "unk_token": "<unk>"}}) is None
    assert _bytes_per_token_bound({"model": {"type": "WordPiece", "vocab": {"a": 0}}}) is None
