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
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str  # "float32" | "bfloat16" | "float16"

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; expected one of {sorted(_DTYPES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)

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
        return (f"layers={self.num_layers} kv_heads={self.num_kv_heads} head_dim={self.head_dim} "
                f"page_size={self.page_size} dtype={self.dtype}")

    def to_dict(self) -> dict[str, int | str]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> KVLayout:
        return cls(**{f.name: values[f.name] for f in fields(cls)})

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
