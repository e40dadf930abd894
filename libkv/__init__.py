"""Paged KV storage and the transfer backends that move KV pages between processes."""

from __future__ import annotations

from libkv.allocator import OutOfPages, PageAllocator
from libkv.layout import KVLayout, LayoutMismatch
from libkv.pool import KVPool

__all__ = ["KVLayout", "KVPool", "LayoutMismatch", "OutOfPages", "PageAllocator"]
