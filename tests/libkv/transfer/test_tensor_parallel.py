"""Workers of different tensor-parallel sizes, in one process: every rank writes its own KV heads
straight into the peer ranks that hold them, a TP-1 worker's plain backend pairs with a TP-N
worker in both directions, and both sides agree on the page checksums the landing check compares.

The ranks' backends copy bytes in-process (tests.libkv.transfer.late_landing, with byte regions),
and the followers are driven through the same RankTransfer calls rank 0 makes over its control
channel in a real worker (libkv.rank_channel.InProcessRank instead of a socket).
"""

from __future__ import annotations

import pytest
import torch

from libkv.landing import TPKVPool, checksums_in_parts
from libkv.layout import KVLayout, LayoutMismatch
from libkv.pool import KVPool
from libkv.rank_channel import InProcessRank
from libkv.transfer import (
    BACKENDS,
    BackendMismatch,
    PeerUnreachable,
    TransferBackend,
    TransferEndpoint,
    TransferState,
)
from libkv.transfer.fake import FakeBackend
from libkv.transfer.hooks import Peer, Transfer
from libkv.transfer.tensor_parallel import RankTransfer, TensorParallelBackend
from tests.libkv.transfer.late_landing import LateLandingBackend

NUM_PAGES = 12
GRANT = bytes(range(16))
# A TP-2 worker's endpoint, byte for byte as workers published it before (registries and gRPC carry it).
GOLDEN_TP2_ENDPOINT = (
    '{"backend": "nixl", "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4, "page_size": 2, '
    '"dtype": "float32"}, "host": "127.0.0.1", "num_pages": 8, "blob": "cGRzZXJ2ZS10cC1lbmRwb2ludHM6WyJ7XCJiY'
    'WNrZW5kXCI6IFwibml4bFwiLCBcImxheW91dFwiOiB7XCJudW1fbGF5ZXJzXCI6IDIsIFwibnVtX2t2X2hlYWRzXCI6IDEsIFwiaGVhZ'
    'F9kaW1cIjogNCwgXCJwYWdlX3NpemVcIjogMiwgXCJkdHlwZVwiOiBcImZsb2F0MzJcIn0sIFwiaG9zdFwiOiBcIjEyNy4wLjAuMVwiL'
    'CBcIm51bV9wYWdlc1wiOiA4LCBcImJsb2JcIjogXCJleUp5WVc1cklqb2dNSDA9XCJ9IiwgIntcImJhY2tlbmRcIjogXCJuaXhsXCIsI'
    'FwibGF5b3V0XCI6IHtcIm51bV9sYXllcnNcIjogMiwgXCJudW1fa3ZfaGVhZHNcIjogMSwgXCJoZWFkX2RpbVwiOiA0LCBcInBhZ2Vfc'
    '2l6ZVwiOiAyLCBcImR0eXBlXCI6IFwiZmxvYXQzMlwifSwgXCJob3N0XCI6IFwiMTI3LjAuMC4xXCIsIFwibnVtX3BhZ2VzXCI6IDgsI'
    'FwiYmxvYlwiOiBcImV5SnlZVzVySWpvZ01YMD1cIn0iXQ=="}')


class RegionsBackend(LateLandingBackend):
    """An in-process one-sided engine that writes byte regions (as mooncake and nixl do); while
    `fail_writes` is set, the engine refuses writes as NIXL does once it saw its peer vanish."""

    writes_regions = True

    def __init__(self, *, timeout_s: float = 5.0) -> None:
        super().__init__(timeout_s=timeout_s)
        self.fail_writes = False

    def _engine_write(self, peer: Peer, record: Transfer):
        if self.fail_writes:
            raise RuntimeError("NIXL_ERR_REMOTE_DISCONNECT")
        return super()._engine_write(peer, record)


@pytest.fixture(autouse=True)
def _regions_engine(monkeypatch):
    # Followers make their backends by name (RankTransfer.create_backend), as real ranks do.
    monkeypatch.setitem(BACKENDS, RegionsBackend.name, (__name__, "RegionsBackend"))


def rank_layout(heads: int) -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=heads, head_dim=4, page_size=2, dtype="float32")


def worker(tp: int, engine: type = RegionsBackend, heads: int = 4) -> tuple[TransferBackend, list[KVPool]]:
    """A worker of `tp` ranks whose model has `heads` KV heads: its backend (registered) and each
    rank's pool, in rank order."""
    layout = rank_layout(heads // tp)
    if tp == 1:
        backend, pool = engine(timeout_s=5.0), KVPool(layout, NUM_PAGES)
        backend.register(pool)
        return backend, [pool]
    followers = [RankTransfer(KVPool(layout, NUM_PAGES), rank, tp) for rank in range(1, tp)]
    channels = [InProcessRank(follower) for follower in followers]
    pool = TPKVPool(layout, NUM_PAGES, "cpu", channels)
    backend = TensorParallelBackend(engine(timeout_s=5.0), channels, {"timeout_s": 5.0})
    backend.register(pool)
    return backend, [pool, *(follower.pool for follower in followers)]


def whole_pages(pools: list[KVPool]) -> torch.Tensor:
    """Every page of the model's KV, the ranks' heads side by side."""
    return torch.cat([pool.buffer for pool in pools], dim=-2)


@pytest.mark.parametrize(("sender_tp", "receiver_tp"),
                         [(1, 1), (1, 2), (2, 1), (2, 2), (2, 4), (4, 2), (1, 4)])
async def test_every_kv_head_lands_on_the_rank_that_holds_it(sender_tp, receiver_tp):
    sender, sender_pools = worker(sender_tp)
    receiver, receiver_pools = worker(receiver_tp)
    generator = torch.Generator().manual_seed(sender_tp * 10 + receiver_tp)
    for pool in sender_pools:
        pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=generator))
    src, dst = [1, 2, 3, 7], [4, 5, 9, 0]
    before = whole_pages(receiver_pools).clone()
    receiver.expect("room-1", dst, GRANT)
    peer = sender.connect(receiver.endpoint())
    assert sender.connect(receiver.endpoint()) == peer  # connected once per peer
    sender.verify_grant(peer, dst, key="room-1", grant=GRANT)
    sent = sender.page_checksums_for(peer, src)
    handle = sender.write(peer, src, dst, key="room-1", grant=GRANT)
    await sender.wait(handle)  # the services' path: awaited on an event loop
    assert sender.poll(handle) is TransferState.DONE and sender.abort(handle) is TransferState.DONE
    after = whole_pages(receiver_pools)
    assert torch.equal(after[dst], whole_pages(sender_pools)[src])
    untouched = [page for page in range(NUM_PAGES) if page not in dst]
    assert torch.equal(after[untouched], before[untouched])
    # What decode's landing check computes over what arrived equals what prefill sent.
    assert checksums_in_parts(receiver_pools[0], dst, sender_tp) == sent
    assert handle.nbytes == len(src) * rank_layout(4).page_nbytes == sum(sender.rank_bytes())
    assert len(sender.rank_bytes()) == sender_tp


def test_a_tp_endpoint_keeps_its_wire_format():
    ranks = [TransferEndpoint("nixl", rank_layout(1), "127.0.0.1", 8, b'{"rank": %d}' % rank)
             for rank in range(2)]
    assert TransferEndpoint.of_ranks(ranks).to_json() == GOLDEN_TP2_ENDPOINT
    assert TransferEndpoint.from_json(GOLDEN_TP2_ENDPOINT).ranks() == ranks
    assert TransferEndpoint.of_ranks(ranks[:1]) == ranks[0] and ranks[0].ranks() == [ranks[0]]


@pytest.mark.parametrize(("sender_tp", "receiver_tp"), [(1, 2), (2, 1)])
def test_whole_page_engines_refuse_other_tp_sizes_naming_both(sender_tp, receiver_tp):
    sender, _ = worker(sender_tp, FakeBackend)
    receiver, _ = worker(receiver_tp, FakeBackend)
    with pytest.raises(BackendMismatch, match=f"KV between --tp-size {sender_tp} and --tp-size {receiver_tp} "
                                              "needs mooncake or nixl"):
        sender.connect(receiver.endpoint())


def test_unmappable_tp_sizes_are_refused_naming_both():
    sender, _ = worker(2, heads=6)
    receiver, _ = worker(3, heads=6)
    with pytest.raises(LayoutMismatch, match=r"--tp-size 2 \(prefill\) and --tp-size 3 \(decode\)"):
        sender.connect(receiver.endpoint())


def test_a_dead_connection_to_one_peer_rank_is_replaced_on_the_next_connect():
    sender, sender_pools = worker(1)
    receiver, _ = worker(2)
    receiver.expect("room-1", [1, 2], GRANT)
    peer = sender.connect(receiver.endpoint())
    sender.fail_writes = True
    failed = sender.write(peer, [0, 1], [1, 2], key="room-1", grant=GRANT)
    assert sender.poll(failed) is TransferState.FAILED
    assert "REMOTE_DISCONNECT" in str(sender.error(failed))
    sender.fail_writes = False
    with pytest.raises(PeerUnreachable, match="is dead"):  # at once, not through the engine again
        sender.write(peer, [0], [1], key="room-1", grant=GRANT)
    fresh = sender.connect(receiver.endpoint())
    assert fresh != peer
    sender.wait_blocking(sender.write(fresh, [0, 1], [1, 2], key="room-1", grant=GRANT))
    assert sender.connect(receiver.endpoint()) == fresh


def test_a_follower_rank_failing_fails_the_whole_write_naming_the_rank():
    sender, _ = worker(2)
    receiver, _ = worker(2)
    receiver.expect("room-1", [3], GRANT)
    peer = sender.connect(receiver.endpoint())
    follower = sender.followers[0].handler.backend
    follower.fail_writes = True
    handle = sender.write(peer, [0], [3], key="room-1", grant=GRANT)
    with pytest.raises(PeerUnreachable, match="tp rank 1: .*REMOTE_DISCONNECT"):
        sender.wait_blocking(handle)
    assert sender.abort(handle) is TransferState.FAILED
    assert sender.rank_bytes() == [handle.nbytes // 2] * 2
