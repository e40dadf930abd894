"""Paged KV storage and the transfer backends that move KV pages between processes.

Names are imported lazily, so `libkv.page_hash` (pure standard library, shared with the gateway)
can be used without importing torch."""

from __future__ import annotations

import importlib

_EXPORTS = {"OutOfPages": "libkv.allocator", "PageAllocator": "libkv.allocator",
            "KVLayout": "libkv.layout", "LayoutMismatch": "libkv.layout", "KVPool": "libkv.pool"}

__all__ = ["KVLayout", "KVPool", "LayoutMismatch", "OutOfPages", "PageAllocator"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'libkv' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
