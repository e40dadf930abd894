"""MLA latent pages between workers of different tensor-parallel sizes, in one process: every rank
holds the whole latent, so each decode rank j receives each page once, whole, from prefill rank
j % p; prefill ranks no decode rank is assigned to write nothing, and both sides agree on the
checksums the landing check compares, over every decode rank's copy.

Sender ranks are filled with DIFFERENT bytes on purpose: a real model's ranks hold the same latent,
but only different bytes show which rank wrote which receiver rank, and that the landing check never
assumes the sender's ranks to be identical. Same in-process engines as test_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch

from libkv.landing import TPKVPool, checksums_in_parts, wait_landed
from libkv.layout import KVLayout, LayoutMismatch
from libkv.pool import KVPool, PageRun
from libkv.rank_channel import InProcessRank
from libkv.transfer import BACKENDS, TransferBackend, TransferEndpoint, TransferState
from libkv.transfer.head_map import latent_receivers
from libkv.transfer.hooks import Peer, Transfer
from libkv.transfer.tensor_parallel import RankTransfer, TensorParallelBackend
from tests.libkv.transfer.late_landing import LateLandingBackend

NUM_PAGES = 10
GRANT = bytes(range(16))
MLA = KVLayout.mla(num_layers=2, kv_lora_rank=6, qk_rope_head_dim=2, page_size=2, dtype="float32")


class WholePagesBackend(LateLandingBackend):
    """An in-process one-sided engine that moves whole pages only (as ucx does), recording the
    kind of every run it was asked to write."""

    name = "mla-whole-pages"
    writes_regions = False

    def __init__(self, *, timeout_s: float = 5.0) -> None:
        super().__init__(timeout_s=timeout_s)
        self.run_types: set[type] = set()

    def _engine_write(self, peer: Peer, record: Transfer):
        self.run_types.update(type(run) for run in record.runs)
        return super()._engine_write(peer, record)


@pytest.fixture(autouse=True)
def _engine(monkeypatch):
    # Followers make their backends by name (RankTransfer.create_backend), as real ranks do.
    monkeypatch.setitem(BACKENDS, WholePagesBackend.name, (__name__, "WholePagesBackend"))


def worker(tp: int, layout: KVLayout = MLA) -> tuple[TransferBackend, list[KVPool], list[WholePagesBackend]]:
    """A worker of `tp` ranks, each with a pool of `layout` (an MLA rank's is the whole model's):
    its backend (registered), each rank's pool and each rank's engine backend, in rank order."""
    if tp == 1:
        backend, pool = WholePagesBackend(), KVPool(layout, NUM_PAGES)
        backend.register(pool)
        return backend, [pool], [backend]
    followers = [RankTransfer(KVPool(layout, NUM_PAGES), rank, tp) for rank in range(1, tp)]
    channels = [InProcessRank(follower) for follower in followers]
    pool = TPKVPool(layout, NUM_PAGES, "cpu", channels)
    local = WholePagesBackend()
    backend = TensorParallelBackend(local, channels, {"timeout_s": 5.0})
    backend.register(pool)
    return backend, [pool, *(follower.pool for follower in followers)], \
        [local, *(follower.backend for follower in followers)]


def test_each_receiver_rank_has_one_writer():
    assert [latent_receivers(1, 2, 0)] == [[0, 1]]
    assert [latent_receivers(2, 1, rank) for rank in range(2)] == [[0], []]
    assert [latent_receivers(2, 2, rank) for rank in range(2)] == [[0], [1]]
    assert [latent_receivers(3, 2, rank) for rank in range(3)] == [[0], [1], []]
    assert [latent_receivers(2, 3, rank) for rank in range(2)] == [[0, 2], [1]]


@pytest.mark.parametrize(("sender_tp", "receiver_tp"), [(1, 1), (1, 2), (2, 1), (2, 2), (3, 2)])
async def test_each_decode_rank_gets_every_page_once_whole_from_its_writer(sender_tp, receiver_tp):
    sender, sender_pools, sender_engines = worker(sender_tp)
    receiver, receiver_pools, _ = worker(receiver_tp)
    generator = torch.Generator().manual_seed(sender_tp * 10 + receiver_tp)
    for pool in sender_pools:
        pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=generator))
    before = [pool.buffer.clone() for pool in receiver_pools]
    src, dst = [1, 2, 3, 7], [4, 5, 9, 0]
    assert receiver.endpoint().layout == MLA  # the whole model's latent page, at any TP size
    receiver.expect("room-1", dst, GRANT)
    peer = sender.connect(receiver.endpoint())
    sender.verify_grant(peer, dst, key="room-1", grant=GRANT)
    sent = sender.page_checksums_for(peer, src)
    handle = sender.write(peer, src, dst, key="room-1", grant=GRANT)
    await sender.wait(handle)
    assert sender.poll(handle) is TransferState.DONE and sender.abort(handle) is TransferState.DONE

    untouched = [page for page in range(NUM_PAGES) if page not in dst]
    for rank, pool in enumerate(receiver_pools):
        assert torch.equal(pool.buffer[dst], sender_pools[rank % sender_tp].buffer[src]), \
            f"decode rank {rank}"
        assert torch.equal(pool.buffer[untouched], before[rank][untouched])
    # Whole pages only (PageRuns, never byte pieces), so an engine that moves whole pages suffices.
    assert set().union(*(engine.run_types for engine in sender_engines)) == {PageRun}
    # What decode's landing check computes over what arrived equals what prefill sent.
    assert checksums_in_parts(receiver_pools[0], dst, sender_tp) == sent
    # Each page once per decode rank: the bytes kv_transfer_bytes_total counts.
    page_bytes = len(src) * MLA.page_nbytes
    assert handle.nbytes == receiver_tp * page_bytes == sum(sender.rank_bytes())
    assert sender.rank_bytes() == [len(latent_receivers(sender_tp, receiver_tp, rank)) * page_bytes
                                   for rank in range(sender_tp)]


@pytest.mark.parametrize(("sender_tp", "receiver_tp"), [(1, 2), (2, 2)])
async def test_a_decode_rank_whose_copy_has_not_landed_fails_the_landing_check(sender_tp, receiver_tp):
    sender, sender_pools, _ = worker(sender_tp)
    receiver, receiver_pools, _ = worker(receiver_tp)
    for rank, pool in enumerate(sender_pools):
        pool.buffer.fill_(rank + 1.0)
    dst = [3, 4]
    receiver_pools[0].poison(dst)  # as decode does before offering pages (a TPKVPool: every rank's)
    receiver.expect("room-1", dst, GRANT)
    peer = sender.connect(receiver.endpoint())
    sent = sender.page_checksums_for(peer, [0, 1])
    sender.wait_blocking(sender.write(peer, [0, 1], dst, key="room-1", grant=GRANT))
    assert await wait_landed(receiver_pools[0], dst, sent, timeout_s=0.5, sender_tp_size=sender_tp) == []
    receiver_pools[-1].poison([4])  # the last rank's copy of page 4 still on its way
    assert await wait_landed(receiver_pools[0], dst, sent, timeout_s=0.05, sender_tp_size=sender_tp) == [4]


@pytest.mark.parametrize(("sender_tp", "receiver_tp"), [(1, 1), (1, 2), (2, 1), (2, 2)])
@pytest.mark.parametrize("sender_is_mla", [True, False])
def test_mla_and_gqa_workers_are_refused_naming_the_fields(sender_tp, receiver_tp, sender_is_mla):
    gqa_tp = receiver_tp if sender_is_mla else sender_tp  # the GQA worker's ranks split 2 KV heads
    gqa = KVLayout(num_layers=2, num_kv_heads=2 // gqa_tp, head_dim=8, page_size=2, dtype="float32")
    sender, _, _ = worker(sender_tp, MLA if sender_is_mla else gqa)
    receiver, _, _ = worker(receiver_tp, gqa if sender_is_mla else MLA)
    with pytest.raises(LayoutMismatch,
                       match="kv_lora_rank: (6 vs 0|0 vs 6); qk_rope_head_dim: (2 vs 0|0 vs 2)"):
        sender.connect(receiver.endpoint())


@pytest.mark.parametrize(("sender_tp", "receiver_tp"), [(1, 2), (2, 2)])
@pytest.mark.parametrize(("field", "theirs"), [("kv_lora_rank", 4), ("qk_rope_head_dim", 4),
                                               ("dtype", "bfloat16"), ("page_size", 4)])
def test_an_mla_layout_mismatch_is_refused_naming_both_values(sender_tp, receiver_tp, field, theirs):
    values = dict(num_layers=2, kv_lora_rank=6, qk_rope_head_dim=2, page_size=2, dtype="float32")
    sender, _, _ = worker(sender_tp)
    receiver, _, _ = worker(receiver_tp, KVLayout.mla(**{**values, field: theirs}))
    with pytest.raises(LayoutMismatch, match=f"{field}: {values[field]} vs {theirs}"):
        sender.connect(receiver.endpoint())


def test_an_mla_endpoint_carries_its_latent_layout_over_the_wire():
    ranks = [TransferEndpoint("nixl", MLA, "127.0.0.1", 8, b'{"rank": %d}' % rank) for rank in range(2)]
    endpoint = TransferEndpoint.of_ranks(ranks)
    assert endpoint.layout == MLA
    assert TransferEndpoint.from_json(endpoint.to_json()) == endpoint and endpoint.ranks() == ranks
