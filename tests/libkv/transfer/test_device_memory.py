"""Which transfer backends take a KV pool in GPU memory: a CUDA build of the engine only. The CPU
venv's Mooncake is the non-CUDA build, which would read a device pointer as host memory, so it must
refuse such a pool by name before touching the engine (a `meta` pool stands for one here: no GPU)."""

from __future__ import annotations

import importlib.util

import pytest

from libkv.layout import KVLayout
from libkv.pool import KVPool
from libkv.transfer.nixl import NixlBackend

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, dtype="float32")


@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="mooncake engine not installed")
def test_mooncake_without_cuda_refuses_a_device_pool_by_name():
    from libkv.transfer.mooncake import MooncakeBackend, _is_cuda_build

    assert not _is_cuda_build()  # the CPU venv installs mooncake-transfer-engine-non-cuda
    backend = MooncakeBackend(host="127.0.0.1")
    with pytest.raises(ValueError, match="needs a CUDA build of the mooncake engine"):
        backend.register(KVPool(LAYOUT, num_pages=4, device="meta"))
    assert backend.pool is None and backend._engine is None  # nothing was started or kept


def test_nixl_builds_are_cuda_builds():
    assert NixlBackend.supports_device_memory()
