"""The store tier: full KV pages written through to a cluster-wide store (Mooncake Store) and
fetched back on a local prefix-cache miss, so a prefix computed on one worker serves every other.

Why in libkv: it is KV memory and its movement (pool pages to a remote store and back), like
libkv/transfer/; the engine only calls it at two hooks of its scheduler (engine/scheduler.py).
- entry.py: the key (chained page hash + model and layout identity) and the value (header + bytes),
  checked on the way back;
- client.py: the store clients (Mooncake Store), every call bounded in time;
- tier.py: StoreTier, the write-through queue and its thread, fetch on miss, up/down and the probe.
"""

from libkv.store.client import StoreClient, StoreError, create_client
from libkv.store.entry import StoreIdentity, model_digest
from libkv.store.tier import StoreStats, StoreTier

__all__ = ["StoreClient", "StoreError", "StoreIdentity", "StoreStats", "StoreTier", "create_client",
           "model_digest"]
