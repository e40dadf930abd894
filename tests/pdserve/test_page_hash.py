"""page_hashes (pdserve/page_hash.py) names every full page exactly as page_hash chained page by page
does: workers and gateways hash prompts with it, and a hash that differs is a missed cache hit."""

from __future__ import annotations

import hashlib
import random
import struct

from pdserve.page_hash import ROOT_HASH, PageHashMemo, iter_page_hashes, page_hash, page_hashes


def chained(tokens: list[int], page_size: int, salts: list[int]) -> list[int]:
    hashes, parent = [], ROOT_HASH
    for index in range(len(tokens) // page_size):
        salt = salts[index] if index < len(salts) else 0
        parent = page_hash(parent, tokens[index * page_size:(index + 1) * page_size], salt)
        hashes.append(parent)
    return hashes


def test_page_hash_is_blake2b_64_of_parent_tokens_and_salt():
    raw = struct.pack("<Q", 7) + struct.pack("<3q", 1, -2, 3) + struct.pack("<Q", 9)
    digest = hashlib.blake2b(raw, digest_size=8).digest()
    assert page_hash(7, [1, -2, 3], 9) == int.from_bytes(digest, "little")


def test_page_hashes_match_the_chain_page_by_page():
    rng = random.Random(5)
    for _ in range(200):
        page_size = rng.choice([1, 4, 16, 17])
        tokens = [rng.randrange(0, 1 << 31) for _ in range(rng.randrange(0, 200))]
        salts = [rng.choice([0, rng.getrandbits(64)]) for _ in range(rng.randrange(0, 6))]
        expected = chained(tokens, page_size, salts)
        assert page_hashes(tokens, page_size, salts=salts) == expected
        assert page_hashes(tuple(tokens), page_size, salts=salts) == expected
        known = rng.randrange(0, len(expected) + 1)
        assert page_hashes(tokens, page_size, expected[:known], salts) == expected  # extended, not redone


def test_hashes_through_a_memo_are_the_chain_and_the_memo_stays_bounded():
    rng = random.Random(6)
    memo = PageHashMemo(max_pages=50)
    shared = [rng.randrange(0, 1 << 31) for _ in range(64)]  # a hot prefix, met again and again
    for _ in range(100):
        page_size = rng.choice([4, 16])
        tokens = shared + [rng.randrange(0, 1 << 31) for _ in range(rng.randrange(0, 100))]
        salts = [rng.choice([0, rng.getrandbits(64)]) for _ in range(rng.randrange(0, 3))]
        expected = chained(tokens, page_size, salts)
        assert list(iter_page_hashes(tokens, page_size, salts=salts, memo=memo)) == expected
        assert list(iter_page_hashes(tokens, page_size, salts=salts, memo=memo)) == expected  # from the memo
        assert len(memo) <= 50


def test_lazy_hashes_are_made_only_as_far_as_they_are_taken():
    tokens = list(range(64))
    pages = iter_page_hashes(tokens, 16)
    assert next(pages) == page_hash(ROOT_HASH, tokens[:16])
    assert list(pages) == page_hashes(tokens, 16)[1:]
