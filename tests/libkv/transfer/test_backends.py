"""Real engines between two processes on 127.0.0.1: exact bytes, abort, a killed peer, refusal,
grants (which pages a sender may write), and where the engines listen.

Every engine runs in a child process (tools.transfer_peer.worker), never in pytest itself: NIXL
and UCX crash at interpreter exit, and a killed receiver must be a real process.
"""

from __future__ import annotations

import importlib.util
import json
import random
import time
from dataclasses import dataclass

import pytest

from libkv.transfer import REAL_BACKENDS, grant_tag
from tools.transfer_peer.client import PeerError, PeerProcess

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
    # The integrity check the PD services run: the sender's checksums of what it wrote equal
    # the receiver's of what arrived.
    assert (pair.sender.call("checksums", pages=src)["checksums"]
            == pair.receiver.call("checksums", pages=dst)["checksums"])


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
    assert pair.sender.call("write", peer=pair.peer, src=src, dst=dst,
                            key="room-after-abort")["state"] == "done"
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
        assert err.value.error_type == "GrantRefused" and "rejected" in err.value.message
    pair.receiver.call("release", key="room-narrow")
    assert page_hashes(pair.receiver) == before


GRANT_1, GRANT_2, GRANT_3 = "a1" * 16, "b2" * 16, "c3" * 16
# Pages of room-g1 spread over the pool: several spans, so several engine reads or descriptors.
ROOM_1_PAGES = [10, 11, 12, 13, 300, 301, 900, NUM_PAGES - 1]
ROOM_2_PAGES = [20, 21, 22]


def refusal(pair: Pair, pages: list[int], key: str, grant: str) -> str:
    with pytest.raises(PeerError) as err:
        pair.sender.call("verify", peer=pair.peer, pages=pages, key=key, grant=grant)
    assert err.value.error_type == "GrantRefused", err.value.message
    return err.value.message


def test_verify_grant_passes_exactly_the_reserved_pages(pair: Pair):
    pair.receiver.call("expect", key="room-g1", pages=ROOM_1_PAGES, grant=GRANT_1)
    try:
        pair.sender.call("verify", peer=pair.peer, pages=ROOM_1_PAGES, key="room-g1", grant=GRANT_1)
        pair.sender.call("verify", peer=pair.peer, pages=[900, 13, 12], key="room-g1", grant=GRANT_1)
        entries = pair.receiver.call("grant_entries",
                                     pages=list(range(8, 16)) + [299, 300, 301, 302])["entries"]
        tag = grant_tag("room-g1", bytes.fromhex(GRANT_1)).hex()
        assert {int(p) for p, e in entries.items() if e == tag} == {10, 11, 12, 13, 300, 301}
        assert all(e == "00" * 16 for p, e in entries.items() if e != tag)
    finally:
        pair.receiver.call("release", key="room-g1")
    entries = pair.receiver.call("grant_entries", pages=ROOM_1_PAGES)["entries"]
    assert set(entries.values()) == {"00" * 16}


def test_verify_grant_refuses_what_was_not_reserved_for_this_room_and_request(pair: Pair):
    pair.receiver.call("expect", key="room-g1", pages=ROOM_1_PAGES, grant=GRANT_1)
    pair.receiver.call("expect", key="room-g2", pages=ROOM_2_PAGES, grant=GRANT_2)
    try:
        message = refusal(pair, ROOM_1_PAGES, "room-g1", GRANT_3)  # wrong grant
        assert "page 10 " in message and "(8 of 8 pages refused)" in message
        assert "page 10 " in refusal(pair, ROOM_1_PAGES, "room-g2", GRANT_2)  # another room's key
        assert "page 10 " in refusal(pair, ROOM_1_PAGES, "room-g2", GRANT_1)
        message = refusal(pair, [12, 13, 21], "room-g1", GRANT_1)  # a page of another room
        assert "page 21 " in message and "(1 of 3 pages refused)" in message
        message = refusal(pair, [14, 300, 500, 501], "room-g1", GRANT_1)  # free pages
        assert "page 14 " in message and "(3 of 4 pages refused)" in message
        pair.receiver.call("release", key="room-g2")
        # Stale: the request's expectation was released (and the room reserved again by a new
        # request with a new grant). Neither the old grant nor the old pages pass any more.
        assert "(3 of 3 pages refused)" in refusal(pair, ROOM_2_PAGES, "room-g2", GRANT_2)
        pair.receiver.call("expect", key="room-g2", pages=[21, 22, 23], grant=GRANT_3)
        assert "page 21 " in refusal(pair, [21, 22], "room-g2", GRANT_2)
        assert "page 20 " in refusal(pair, [20, 21], "room-g2", GRANT_3)
        pair.sender.call("verify", peer=pair.peer, pages=[21, 22, 23], key="room-g2", grant=GRANT_3)
        # The key alone (no grant) is a different binding too.
        assert "page 10 " in refusal(pair, ROOM_1_PAGES, "room-g1", "")
    finally:
        pair.receiver.call("release", key="room-g1")
        pair.receiver.call("release", key="room-g2")
    assert "(8 of 8 pages refused)" in refusal(pair, ROOM_1_PAGES, "room-g1", GRANT_1)


def test_verify_grant_of_many_scattered_pages(pair: Pair):
    # 400 single pages: for ucx a request header too big to travel inline (VERIFY_LONG); for the
    # one-sided engines pages two apart still make one span, so one read.
    pages = [1 + 2 * i for i in range(400)]
    pair.receiver.call("expect", key="room-g4", pages=pages, grant=GRANT_1)
    try:
        pair.sender.call("verify", peer=pair.peer, pages=pages[::-1], key="room-g4", grant=GRANT_1)
        message = refusal(pair, [*pages[:300], 2, *pages[300:]], "room-g4", GRANT_1)
        assert "page 2 " in message and "(1 of 401 pages refused)" in message
    finally:
        pair.receiver.call("release", key="room-g4")


def test_two_sided_receiver_refuses_a_wrong_grant(pair: Pair):
    if pair.backend != "ucx":
        pytest.skip("one-sided receivers cannot refuse a write: their senders verify_grant first")
    before = page_hashes(pair.receiver)
    pair.receiver.call("expect", key="room-g3", pages=[600, 601, 700], grant=GRANT_1)
    try:
        for grant in (GRANT_2, "", GRANT_1[:-2]):
            with pytest.raises(PeerError) as err:
                pair.sender.call("write", peer=pair.peer, src=[3, 4, 5], dst=[600, 601, 700], key="room-g3",
                                 grant=grant)
            assert err.value.error_type == "GrantRefused"
            assert "page 600 " in err.value.message and "(3 of 3 pages refused" in err.value.message
        assert page_hashes(pair.receiver) == before  # nothing landed
        # Right grant, but one run reaches a page of no one: that run alone goes to scratch.
        with pytest.raises(PeerError) as err:
            pair.sender.call("write", peer=pair.peer, src=[3, 4, 5], dst=[600, 601, 702], key="room-g3",
                             grant=GRANT_1)
        assert err.value.error_type == "GrantRefused" and "page 702 " in err.value.message
        after = page_hashes(pair.receiver)
        assert after[702] == before[702] and after[600] != before[600]
        reply = pair.sender.call("write", peer=pair.peer, src=[3, 4, 5], dst=[600, 601, 700], key="room-g3",
                                 grant=GRANT_1)
        assert reply["state"] == "done"
        assert page_hashes(pair.receiver, [700])[700] == page_hashes(pair.sender, [5])[5]
    finally:
        pair.receiver.call("release", key="room-g3")


def test_engine_listeners_bind_only_the_given_host(pair: Pair):
    for proc in (pair.sender, pair.receiver):
        listeners = proc.call("listeners")["listeners"]
        assert listeners, f"{pair.backend}: no listening socket found in {proc.name}"
        assert {ip for ip, _port in listeners} <= {"127.0.0.1", "::ffff:127.0.0.1"}, listeners
        if pair.backend == "mooncake":
            assert len(listeners) == 2  # the handshake socket and the TCP transport's acceptor


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
    assert (err.value.error_type == "BackendMismatch"
            and f"{pair.backend} vs {other_backend}" in err.value.message)


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
    assert pair.sender.call("write", peer=pair.peer, src=[9], dst=[7],
                            key="room-after-kill")["state"] == "done"
