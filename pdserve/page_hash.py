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
from collections.abc import Iterator, Sequence

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
    hashes = list(start)
    hashes.extend(iter_page_hashes(token_ids, page_size, first=len(hashes),
                                   parent=hashes[-1] if hashes else ROOT_HASH, salts=salts))
    return hashes


def iter_page_hashes(token_ids: Sequence[int], page_size: int, first: int = 0, parent: int = ROOT_HASH,
                     salts: Sequence[int] = (), memo: PageHashMemo | None = None) -> Iterator[int]:
    """page_hashes' hashes from page `first` on (`parent`: the hash of the page before it), made one
    at a time as they are taken: a router that stops at the first page no worker holds hashes no
    further (a blake2b per page is most of a routing decision's work). `memo`: pages hashed before
    are looked up there instead of hashed again."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    end = len(token_ids) // page_size
    if first >= end:
        return
    # page_hash's bytes, made once for all pages (one array per page was a third of a routing decision)
    tokens = array("q", token_ids[first * page_size:end * page_size]).tobytes()
    page_bytes = page_size * 8  # "q": 8 bytes a token
    blake2b, pack, from_bytes = hashlib.blake2b, _PARENT.pack, int.from_bytes
    known = memo.get if memo is not None else None
    salted = len(salts)
    for index, offset in enumerate(range(0, len(tokens), page_bytes), first):
        data = pack(parent) + tokens[offset:offset + page_bytes]
        if index < salted and salts[index]:
            data += pack(salts[index])
        if known is None:
            parent = from_bytes(blake2b(data, digest_size=8).digest(), "little")
        else:
            hashed = known(data)
            if hashed is None:
                hashed = from_bytes(blake2b(data, digest_size=8).digest(), "little")
                memo.remember(data, hashed)  # type: ignore[union-attr]
            parent = hashed
        yield parent


class PageHashMemo(dict[bytes, int]):
    """Page hashes computed lately, by the exact bytes hashed (the parent's hash, the page's tokens,
    its salt), at most `max_pages` of them. A router
    hashes the same hot prefixes (system prompts, shared documents) request after request: a lookup
    costs about a third of a blake2b. Exact by construction: a key is the whole input, not a digest
    of it. About 350 bytes a page at 16-token pages. Full, it starts over empty (dropping the
    earliest one at a time would make a dict skip ever more deleted slots); hot pages return on
    their next request."""

    def __init__(self, max_pages: int = 8192) -> None:
        super().__init__()
        self.max_pages = max_pages

    def remember(self, data: bytes, hashed: int) -> None:
        if len(self) >= self.max_pages:
            self.clear()
        self[data] = hashed


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
