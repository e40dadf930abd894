"""MLA latent pages through the real one-sided engines (mooncake, nixl) between two processes on
127.0.0.1, between workers of TP 1 and 2: each decode rank j receives every page once, whole, from
prefill rank j % p, and what decode's landing check computes equals what prefill sent.

Each worker's ranks live in its one process, each rank with its own engine
(tools.transfer_peer.worker, `tp_size`), and each rank's pool is filled with different bytes, so
the hashes show which rank wrote which.
"""

from __future__ import annotations

import importlib.util

import pytest

from libkv.layout import KVLayout
from libkv.transfer.head_map import latent_receivers
from tools.transfer_peer.client import PeerProcess

pytestmark = pytest.mark.e2e

ENGINE_MODULES = {"mooncake": "mooncake", "nixl": "nixl_cu12"}  # ucxx: one backend per process
# DeepSeek's latent (512) and rope key (64), 4 layers, 16 tokens a page, bf16: 72 KiB per page.
MLA = KVLayout.mla(num_layers=4, kv_lora_rank=512, qk_rope_head_dim=64, page_size=16, dtype="bfloat16")
NUM_PAGES = 48
GRANT = bytes(range(16)).hex()


@pytest.mark.parametrize(("sender_tp", "receiver_tp"), [(1, 2), (2, 1), (2, 2)], ids=lambda tp: f"tp{tp}")
@pytest.mark.parametrize("backend", sorted(ENGINE_MODULES))
def test_latent_pages_land_whole_once_per_decode_rank(backend, sender_tp, receiver_tp):
    if importlib.util.find_spec(ENGINE_MODULES[backend]) is None:
        pytest.skip(f"{backend} engine not installed")
    sender, receiver = PeerProcess("sender"), PeerProcess("receiver")
    try:
        for proc, tp in ((sender, sender_tp), (receiver, receiver_tp)):  # both start their engines at once
            proc.send("init", backend=backend, layout=MLA.to_dict(), num_pages=NUM_PAGES, timeout_s=10.0,
                      tp_size=tp)
        sender.reply()
        endpoint = receiver.reply()["endpoint"]
        sender.call("fill", seed=1)
        receiver.call("fill", seed=2)
        src, dst = [1, 2, 3, 10, 11, 30], [40, 41, 5, 6, 7, 20]
        untouched = [page for page in range(NUM_PAGES) if page not in dst]
        before = [receiver.call("hashes", pages=untouched, rank=rank)["hashes"]
                  for rank in range(receiver_tp)]
        peer = sender.call("connect", endpoint=endpoint)["peer"]
        receiver.call("expect", key="room-1", pages=dst, grant=GRANT)
        sender.call("verify", peer=peer, pages=dst, key="room-1", grant=GRANT)
        sent = sender.call("sent_checksums", peer=peer, pages=src)["checksums"]
        assert sender.call("write", peer=peer, src=src, dst=dst, key="room-1", grant=GRANT)["state"] == "done"

        for rank in range(receiver_tp):
            arrived = receiver.call("hashes", pages=dst, rank=rank)["hashes"]
            written = sender.call("hashes", pages=src, rank=rank % sender_tp)["hashes"]
            assert [arrived[str(p)] for p in dst] == [written[str(p)] for p in src], f"decode rank {rank}"
            assert receiver.call("hashes", pages=untouched, rank=rank)["hashes"] == before[rank]
        assert receiver.call("landed_checksums", pages=dst, sender_tp_size=sender_tp)["checksums"] == sent
        page_bytes = len(src) * MLA.page_nbytes
        assert sender.call("rank_bytes")["rank_bytes"] == [
            len(latent_receivers(sender_tp, receiver_tp, rank)) * page_bytes for rank in range(sender_tp)]
    finally:
        sender.close()
        receiver.close()
