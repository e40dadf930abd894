"""Chained page hashes: the name of a full KV page by its content and everything before it.

The hash of page i is blake2b-64 of (hash of page i-1, the page's token ids), so equal hashes mean
equal prefixes up to that page, whatever else is in the cache. Workers key their prefix caches by
these hashes and publish them as KV events; the gateway computes them for a prompt (with the
worker's page size, from its registration) and counts how many leading hashes a worker holds.
Both import this one function. Pure standard library: the gateway must not import torch.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence

ROOT_HASH = 0  # the "parent" of a prompt's first page
_PARENT = struct.Struct("<Q")


def page_hash(parent: int, tokens: Sequence[int], salt: int = 0) -> int:
    """The hash of a page holding `tokens`, after the page whose hash is `parent`; an unsigned 64-bit int.

    `salt` (non-zero): what else decides the page's K/V besides its tokens, the digests of the
    images whose tokens it holds (`image_page_salts`): an image's pad tokens are the same ids
    whatever the image. 0 leaves the hash of a text page as it always was."""
    digest = hashlib.blake2b(struct.pack("<Q", parent), digest_size=8)
    digest.update(array("q", tokens).tobytes())
    if salt:
        digest.update(struct.pack("<Q", salt))
    return int.from_bytes(digest.digest(), "little")


def image_page_salts(spans: Sequence[tuple[int, int, int]], page_size: int, num_tokens: int) -> list[int]:
    """Per page of a prompt of `num_tokens`, the salt of the images whose tokens it holds; `spans`
    are (first token, end token, 64-bit digest) per image. Later pages need none: the chain carries it."""
    salts = [0] * -(-num_tokens // page_size)
    for first, end, digest in spans:
        for page in range(first // page_size, -(-end // page_size)):
            mixed = hashlib.blake2b(struct.pack("<QQ", salts[page], digest), digest_size=8).digest()
            salts[page] = int.from_bytes(mixed, "little") or 1
    return salts


def page_hashes(token_ids: Sequence[int], page_size: int, start: Sequence[int] = (),
                salts: Sequence[int] = ()) -> list[int]:
    """Hashes of every full page of `token_ids` (a trailing partial page has none).

    `start`: hashes already known for the leading pages (extended, not recomputed). `salts`: per
    page, `page_hash`'s salt (pages past its end have none)."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    hashes = list(start)
    parent = hashes[-1] if hashes else ROOT_HASH
    first, end = len(hashes), len(token_ids) // page_size
    if first >= end:
        return hashes
    # page_hash's bytes, made once for all pages (the gateway hashes every prompt it routes: one
    # array per page was a third of a routing decision)
    tokens = memoryview(array("q", token_ids[first * page_size:end * page_size]).tobytes())
    page_bytes = page_size * 8  # "q": 8 bytes a token
    for offset, index in enumerate(range(first, end)):
        digest = hashlib.blake2b(_PARENT.pack(parent), digest_size=8)
        digest.update(tokens[offset * page_bytes:(offset + 1) * page_bytes])
        salt = salts[index] if index < len(salts) else 0
        if salt:
            digest.update(_PARENT.pack(salt))
        parent = int.from_bytes(digest.digest(), "little")
        hashes.append(parent)
    return hashes


def adapter_salt(name: str) -> int:
    """The salt of every prompt run under the LoRA adapter `name` (its key: name and weights'
    digest; non-zero): its K/V differs from the base model's and every other adapter's."""
    digest = hashlib.blake2b(b"lora:" + name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


def with_adapter(salts: Sequence[int], adapter: str | None) -> list[int]:
    """`salts` with the adapter's salt mixed into the first page's (the chain carries it to the
    rest), so no page is shared across adapters or with the base; unchanged for the base model."""
    if adapter is None:
        return list(salts)
    mixed = list(salts) or [0]
    digest = hashlib.blake2b(struct.pack("<QQ", mixed[0], adapter_salt(adapter)), digest_size=8).digest()
    mixed[0] = int.from_bytes(digest, "little") or 1
    return mixed
