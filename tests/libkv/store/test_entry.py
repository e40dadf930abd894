"""The store tier's keys and values (libkv/store/entry.py): what makes a foreign or damaged entry a
miss, and the flags that refuse a setup the tier cannot serve."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.config import EngineConfig
from libkv.layout import KVLayout
from libkv.store import entry
from libkv.store.entry import StoreIdentity, model_digest
from pdserve.page_hash import page_hashes
from tools.models.tiny_model import write_tiny_model

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float32")


def test_every_part_of_the_identity_changes_the_key():
    base = StoreIdentity("m0", LAYOUT)
    others = [StoreIdentity("m1", LAYOUT), StoreIdentity("m0", replace(LAYOUT, dtype="bfloat16")),
              StoreIdentity("m0", replace(LAYOUT, page_size=8)),
              StoreIdentity("m0", replace(LAYOUT, num_layers=3)),
              StoreIdentity("m0", LAYOUT, tp_rank=1, tp_size=2),
              StoreIdentity("m0", LAYOUT, tp_rank=0, tp_size=2)]
    keys = {base.key(7)} | {other.key(7) for other in others}
    assert len(keys) == 1 + len(others)
    assert base.key(7) == StoreIdentity("m0", LAYOUT).key(7) and base.key(7) != base.key(8)


def test_random_weight_checkpoints_of_one_config_differ(tmp_path):
    a = write_tiny_model(tmp_path / "a", preset="tiny", seed=0)
    b = write_tiny_model(tmp_path / "b", preset="tiny", seed=1)
    again = write_tiny_model(tmp_path / "again", preset="tiny", seed=0)
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()
    assert model_digest(str(a)) != model_digest(str(b))
    assert model_digest(str(a)) == model_digest(str(again))  # a copy elsewhere shares its entries


def test_check_accepts_only_the_page_it_expects():
    tokens = list(range(8))
    hashes = page_hashes(tokens, 4)
    data = bytes(range(256)) * 2
    digest = entry.tokens_hash(hashes[0], tokens[4:])
    value = entry.encode(hashes[1], digest, data)
    assert entry.check(value, hashes[1], digest, len(data))
    flipped = bytearray(value)
    flipped[-100] ^= 1
    assert not entry.check(bytes(flipped), hashes[1], digest, len(data))  # a flipped KV byte
    assert not entry.check(value, hashes[0], digest, len(data))  # another page's key
    assert not entry.check(value, hashes[1], entry.tokens_hash(hashes[0], [9, 9, 9, 9]),
                           len(data))  # other tokens
    assert not entry.check(value, hashes[1], digest, len(data) + 2)  # another layout's page size
    assert not entry.check(value[:-1], hashes[1], digest, len(data))  # torn
    assert not entry.check(b"", hashes[1], digest, len(data))  # missing


@pytest.mark.parametrize("flags, message", [
    (dict(), "--hicache-mooncake-master"),
    (dict(hicache_mooncake_master="127.0.0.1:1", disable_radix_cache=True), "prefix cache"),
    (dict(hicache_mooncake_master="127.0.0.1:1", tp_size=2), "one rank"),
    (dict(hicache_mooncake_master="127.0.0.1:1", hicache_storage_backend="lmcache"), "must be mooncake"),
    (dict(hicache_mooncake_master="127.0.0.1:1", hicache_timeout=0), "positive"),
])
def test_flags_the_tier_cannot_serve_are_refused(flags, message, monkeypatch):
    monkeypatch.delenv("PDSERVE_HICACHE_MOONCAKE_MASTER", raising=False)
    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    with pytest.raises(ValueError, match=message):
        EngineConfig(model_path="m", enable_hierarchical_cache=True, **flags)


def test_the_master_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("PDSERVE_HICACHE_MOONCAKE_MASTER", raising=False)
    monkeypatch.setenv("MOONCAKE_MASTER", "10.0.0.1:50051")
    assert EngineConfig(model_path="m").hicache_mooncake_master == "10.0.0.1:50051"
    monkeypatch.setenv("PDSERVE_HICACHE_MOONCAKE_MASTER", "10.0.0.2:50051")
    assert EngineConfig(model_path="m").hicache_mooncake_master == "10.0.0.2:50051"
