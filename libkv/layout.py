"""KVLayout: the shape and dtype of one KV page, compared by both sides of a transfer."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LayoutMismatch(ValueError):
    """Two KV layouts that must agree do not; the message names both values of every difference."""


@dataclass(frozen=True)
class KVLayout:
    """What a KV page holds. Two workers can exchange pages only if their layouts are equal.

    A page holds `page_size` consecutive tokens of one request, for every layer, K and V:
    the page's tensor shape is `page_shape` and the pool is page-major (see libkv.pool).

    MLA models (DeepSeek) store no K and V per head: per token and layer one row of the compressed
    latent (`kv_lora_rank` values) followed by the rotated rope key (`qk_rope_head_dim`). Such a
    layout has `kv_lora_rank > 0`, one "plane" instead of K and V, one "head" of
    `kv_lora_rank + qk_rope_head_dim` values, and the same contents on every tensor-parallel rank.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str  # "float32" | "bfloat16" | "float16"
    kv_lora_rank: int = 0  # > 0: an MLA latent layout
    qk_rope_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; expected one of {sorted(_DTYPES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")
        if self.kv_lora_rank < 0 or self.qk_rope_head_dim < 0:
            raise ValueError("KVLayout.kv_lora_rank and qk_rope_head_dim must not be negative")
        latent_width = self.kv_lora_rank + self.qk_rope_head_dim
        if self.is_mla and (self.num_kv_heads != 1 or self.head_dim != latent_width):
            raise ValueError(f"an MLA KV layout has one head of kv_lora_rank + qk_rope_head_dim = "
                             f"{latent_width} values, got {self.num_kv_heads} "
                             f"heads of {self.head_dim}")
        if not self.is_mla and self.qk_rope_head_dim:
            raise ValueError("KVLayout.qk_rope_head_dim is set but kv_lora_rank is 0 (not an MLA layout)")

    @classmethod
    def mla(cls, num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int, page_size: int,
            dtype: str) -> KVLayout:
        """The latent layout of an MLA model: one plane, one head of latent + rope key per token."""
        return cls(num_layers=num_layers, num_kv_heads=1, head_dim=kv_lora_rank + qk_rope_head_dim,
                   page_size=page_size, dtype=dtype, kv_lora_rank=kv_lora_rank,
                   qk_rope_head_dim=qk_rope_head_dim)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def planes(self) -> int:
        """2 (K and V) per layer, or 1 (the MLA latent row)."""
        return 1 if self.is_mla else 2

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, self.planes, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def page_nbytes(self) -> int:
        n = 1
        for dim in self.page_shape:
            n *= dim
        return n * self.itemsize

    @property
    def token_nbytes(self) -> int:
        """KV bytes of one token across all layers."""
        return self.page_nbytes // self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def describe(self) -> str:
        if self.is_mla:
            return (f"layers={self.num_layers} mla kv_lora_rank={self.kv_lora_rank} "
                    f"qk_rope_head_dim={self.qk_rope_head_dim} page_size={self.page_size} dtype={self.dtype}")
        return (f"layers={self.num_layers} kv_heads={self.num_kv_heads} head_dim={self.head_dim} "
                f"page_size={self.page_size} dtype={self.dtype}")

    def to_dict(self) -> dict[str, int | str]:
        """The fields by name; a GQA layout leaves out the MLA fields (zero), so its dict, and the
        transfer endpoints that carry it, read as they did before MLA existed."""
        values = asdict(self)
        if not self.is_mla:
            del values["kv_lora_rank"], values["qk_rope_head_dim"]
        return values

    @classmethod
    def from_dict(cls, values: dict) -> KVLayout:
        return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})

    def differences(self, other: KVLayout) -> list[str]:
        """Each differing field as 'name: mine vs theirs'."""
        return [f"{f.name}: {getattr(self, f.name)} vs {getattr(other, f.name)}"
                for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    def check_compatible(self, other: KVLayout, *, mine: str = "local", theirs: str = "remote") -> None:
        """Raise LayoutMismatch naming both layouts if `other` differs from this one."""
        diffs = self.differences(other)
        if diffs:
            raise LayoutMismatch(
                f"KV layout mismatch ({mine} vs {theirs}): {'; '.join(diffs)} "
                f"[{mine}: {self.describe()}] [{theirs}: {other.describe()}]")
