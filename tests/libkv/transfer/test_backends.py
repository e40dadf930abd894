"""Real engines between two processes on 127.0.0.1: exact bytes, abort, a killed peer, refusal.

Every engine runs in a child process (libkv.transfer.peer_worker), never in pytest itself: NIXL
and UCX crash at interpreter exit, and a killed receiver must be a real process.
"""

from __future__ import annotations

import importlib.util
import json
import random
import time
from dataclasses import dataclass

import pytest

from libkv.transfer import REAL_BACKENDS
from libkv.transfer.peer_client import PeerError, PeerProcess

pytestmark = pytest.mark.e2e

ENGINE_MODULES = {"mooncake": "mooncake", "nixl": "nixl_cu12", "ucx": "ucxx"}
NUM_PAGES = 1100
TIMEOUT_S = 5.0


def layout_for(dtype: str) -> dict:
    # 4 layers x K/V x 16 tokens x 2 heads x 64 dims: 64 KiB (fp32) or 32 KiB (bf16) per page
    return dict(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=dtype)


@dataclass
class Pair:
    backend: str
    dtype: str
    sender: PeerProcess
    receiver: PeerProcess
    receiver_endpoint: str
    peer: str


@pytest.fixture(scope="module", params=[(b, d) for b in REAL_BACKENDS for d in ("float32", "bfloat16")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def pair(request):
    backend, dtype = request.param
    if importlib.util.find_spec(ENGINE_MODULES[backend]) is None:
        pytest.skip(f"{backend} engine not installed")
    sender, receiver = PeerProcess("sender"), PeerProcess("receiver")
    try:
        for proc in (sender, receiver):  # both start their engines at once
            proc.send("init", backend=backend, layout=layout_for(dtype), num_pages=NUM_PAGES,
                      timeout_s=TIMEOUT_S)
        sender.reply()
        receiver_endpoint = receiver.reply()["endpoint"]
        sender.call("fill", seed=1)
        receiver.call("fill", seed=2)
        peer = sender.call("connect", endpoint=receiver_endpoint)["peer"]
        yield Pair(backend, dtype, sender, receiver, receiver_endpoint, peer)
    finally:
        sender.close()
        receiver.close()


def scattered_runs(rng: random.Random, num_runs: int, limit: int) -> tuple[list[int], list[int]]:
    """Page lists with runs of 1-8 pages at unrelated places on each side (src ids != dst ids)."""
    src_free, dst_free = set(range(0, limit // 2)), set(range(limit // 2, limit))
    src, dst = [], []
    for _ in range(num_runs):
        length = rng.randint(1, 8)
        s = rng.choice([p for p in src_free if all(p + i in src_free for i in range(length))])
        d = rng.choice([p for p in dst_free if all(p + i in dst_free for i in range(length))])
        src += range(s, s + length)
        dst += range(d, d + length)
        src_free -= set(range(s - 1, s + length + 1))  # keep runs apart so they do not merge
        dst_free -= set(range(d - 1, d + length + 1))
    return src, dst


def page_hashes(proc: PeerProcess, pages=None) -> dict[int, str]:
    reply = proc.call("hashes", **({} if pages is None else {"pages": pages}))
    return {int(p): h for p, h in reply["hashes"].items()}


def test_scattered_pages_arrive_exactly(pair: Pair):
    rng = random.Random(f"{pair.backend}-{pair.dtype}")
    src, dst = scattered_runs(rng, num_runs=12, limit=400)
    src_hashes = page_hashes(pair.sender, src)
    before = page_hashes(pair.receiver)
    pair.receiver.call("expect", key="room-exact", pages=dst)
    reply = pair.sender.call("write", peer=pair.peer, src=src, dst=dst, key="room-exact")
    pair.receiver.call("release", key="room-exact")
    assert reply["state"] == "done" and reply["runs"] == 12
    after = page_hashes(pair.receiver)
    for s, d in zip(src, dst, strict=True):
        assert after[d] == src_hashes[s] != before[d], f"page {s} -> {d}"
    untouched = set(range(NUM_PAGES)) - set(dst)
    assert all(after[p] == before[p] for p in untouched)


def test_many_single_page_runs_arrive_exactly(pair: Pair):
    # 500 runs: one engine write each (and, for ucx, a header too big to travel inline)
    src, dst = [2 * i for i in range(500)], [2 * i + 1 for i in range(500)]
    src_hashes = page_hashes(pair.sender, src)
    pair.receiver.call("expect", key="room-many", pages=dst)
    reply = pair.sender.call("write", peer=pair.peer, src=src, dst=dst, key="room-many")
    pair.receiver.call("release", key="room-many")
    assert reply["runs"] == 500
    dst_hashes = page_hashes(pair.receiver, dst)
    assert [src_hashes[p] for p in src] == [dst_hashes[p] for p in dst]


def test_abort_mid_transfer_leaves_both_sides_usable(pair: Pair):
    # 56 MiB (fp32) in 56 runs of 16 pages, one-page gaps between runs on the destination side
    big_src = list(range(0, 896))
    big_dst = [40 + run * 17 + i for run in range(56) for i in range(16)]
    before = page_hashes(pair.receiver)
    pair.receiver.call("expect", key="room-abort", pages=big_dst)
    reply = pair.sender.call("write", peer=pair.peer, src=big_src, dst=big_dst, key="room-abort", abort=True)
    assert reply["runs"] == 56
    assert reply["state"] in ("aborted", "done")  # done only if it finished before abort() ran
    pair.receiver.call("release", key="room-abort")  # safe: the sender's abort() has returned
    after = page_hashes(pair.receiver)
    outside = set(range(NUM_PAGES)) - set(big_dst)  # includes the gaps between runs
    assert all(after[p] == before[p] for p in outside)

    src, dst = [1, 2, 3, 500], [1070, 1071, 1072, 5]
    pair.receiver.call("expect", key="room-after-abort", pages=dst)
    assert pair.sender.call("write", peer=pair.peer, src=src, dst=dst, key="room-after-abort")["state"] == "done"
    pair.receiver.call("release", key="room-after-abort")
    src_hashes, dst_hashes = page_hashes(pair.sender, src), page_hashes(pair.receiver, dst)
    assert [src_hashes[p] for p in src] == [dst_hashes[p] for p in dst]


def test_two_sided_receiver_drops_data_it_did_not_expect(pair: Pair):
    if pair.backend != "ucx":
        pytest.skip("only a two-sided backend can refuse data; one-sided receivers rely on the rule")
    before = page_hashes(pair.receiver)
    pair.receiver.call("expect", key="room-narrow", pages=[100, 101])
    for key, dst in (("room-unknown", [100, 101]), ("room-narrow", [101, 102])):
        with pytest.raises(PeerError) as err:
            pair.sender.call("write", peer=pair.peer, src=[3, 4], dst=dst, key=key)
        assert "rejected" in err.value.message
    pair.receiver.call("release", key="room-narrow")
    assert page_hashes(pair.receiver) == before


def test_layout_or_backend_mismatch_is_refused_naming_both(pair: Pair):
    raw = json.loads(pair.receiver_endpoint)
    other_dtype = "float16" if pair.dtype != "float16" else "float32"
    raw["layout"] = dict(raw["layout"], page_size=32, dtype=other_dtype)
    with pytest.raises(PeerError) as err:
        pair.sender.call("connect", endpoint=json.dumps(raw))
    assert err.value.error_type == "LayoutMismatch"
    assert "page_size: 16 vs 32" in err.value.message
    assert f"dtype: {pair.dtype} vs {other_dtype}" in err.value.message
    other_backend = "fake" if pair.backend != "fake" else "nixl"
    raw = dict(json.loads(pair.receiver_endpoint), backend=other_backend)
    with pytest.raises(PeerError) as err:
        pair.sender.call("connect", endpoint=json.dumps(raw))
    assert err.value.error_type == "BackendMismatch" and f"{pair.backend} vs {other_backend}" in err.value.message


def test_killed_receiver_gives_the_sender_an_error(pair: Pair):
    victim = PeerProcess("victim")
    try:
        victim.send("init", backend=pair.backend, layout=layout_for(pair.dtype), num_pages=NUM_PAGES,
                    timeout_s=TIMEOUT_S)
        endpoint = victim.reply()["endpoint"]
        peer = pair.sender.call("connect", endpoint=endpoint)["peer"]
        pages = list(range(512))
        victim.call("expect", key="room-kill", pages=pages)
        pair.sender.send("write_until_error", peer=peer, src=pages, dst=pages, key="room-kill",
                         max_seconds=60.0)
        time.sleep(0.5)  # let writes flow, then kill the receiver in the middle of one
        victim.kill()
        # timeout_s is 5: the error must come well before this generous deadline.
        reply = pair.sender.reply(timeout=45.0, check=False)
        assert reply.get("error_type") in ("PeerUnreachable", "TransferTimeout", "TransferError"), reply
    finally:
        victim.close()
    # The sender still works with its live peer.
    pair.receiver.call("expect", key="room-after-kill", pages=[7])
    assert pair.sender.call("write", peer=pair.peer, src=[9], dst=[7], key="room-after-kill")["state"] == "done"
