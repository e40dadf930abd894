"""What one stored page is: its key and its value, and the check a fetched value must pass.

Key: `pdserve/<identity>/<page hash>`. The chained page hash (pdserve.page_hash) names the page by
its tokens and everything before them; the identity names everything else its bytes depend on: the
model (a digest of config.json and of the start of every weight file, so two random-weight
checkpoints with one config differ), the KV layout (layers, heads, head dim, page size, dtype) and
the tensor-parallel rank and size. Workers that differ in any of them never share a key, so a
foreign entry is never even read.

Value: a fixed header then the page's bytes (all layers, K and V, as in the pool). The header holds
the page hash, a hash of the page's parent hash and token ids, the byte count and xxh3_64 of the
bytes. A fetched value is used only if all four match what the fetching worker expects: a
corrupted entry (flipped bytes, a torn write) or a key collision is a miss, never an answer.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import xxhash

from libkv.layout import KVLayout

MAGIC = b"PDKVHC01"
_HEADER = struct.Struct("<8sQQQQ")  # magic, page hash, tokens hash, nbytes, checksum
HEADER_NBYTES = _HEADER.size
_WEIGHT_PREFIX_NBYTES = 1 << 20


def model_digest(model_path: str) -> str:
    """A short digest of a checkpoint: config.json, and the name, size and first MiB of each
    *.safetensors file (the tensor header and the start of the weights: cheap, and enough to tell
    random-weight checkpoints of one config apart)."""
    folder = Path(model_path)
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for weights in sorted(folder.glob("*.safetensors")):
        digest.update(weights.name.encode())
        digest.update(struct.pack("<Q", weights.stat().st_size))
        with open(weights, "rb") as f:
            digest.update(f.read(_WEIGHT_PREFIX_NBYTES))
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class StoreIdentity:
    """Everything besides the tokens that a page's bytes depend on."""

    model: str  # model_digest()
    layout: KVLayout
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def prefix(self) -> str:
        fields = f"{self.model}|{self.layout.describe()}|tp{self.tp_rank}/{self.tp_size}|{MAGIC.decode()}"
        return f"pdserve/{hashlib.sha256(fields.encode()).hexdigest()[:16]}"

    def key(self, page_hash: int) -> str:
        return f"{self.prefix}/{page_hash:016x}"


def tokens_hash(parent: int, tokens: Sequence[int]) -> int:
    """xxh3_64 of a page's parent hash and token ids: what the header says the page holds."""
    return xxhash.xxh3_64_intdigest(struct.pack("<Q", parent) + array("q", tokens).tobytes())


def encode(page_hash: int, tokens_digest: int, data: bytes | memoryview) -> bytes:
    header = _HEADER.pack(MAGIC, page_hash, tokens_digest, len(data), xxhash.xxh3_64_intdigest(data))
    return header + bytes(data)


def check(value: bytes, page_hash: int, tokens_digest: int, nbytes: int) -> bool:
    """True if `value` is the page `page_hash` holding those tokens, its `nbytes` bytes intact."""
    if len(value) != HEADER_NBYTES + nbytes:
        return False
    magic, stored_hash, stored_tokens, stored_nbytes, checksum = _HEADER.unpack_from(value)
    if (magic, stored_hash, stored_tokens, stored_nbytes) != (MAGIC, page_hash, tokens_digest, nbytes):
        return False
    return xxhash.xxh3_64_intdigest(memoryview(value)[HEADER_NBYTES:]) == checksum
