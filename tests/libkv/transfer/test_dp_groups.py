"""A worker with DP attention groups, in one process: each group's pages live on its own ranks, a
room's KV is written from the sender group holding it into the receiver group holding its
reservation (and nowhere else), and both sides agree on the checksums the landing check compares,
whatever the peer's layout (plain TP, or DP groups of another size).

Ranks are in-process RankTransfers behind InProcessRank channels, as
tests.libkv.transfer.test_tensor_parallel.
"""

from __future__ import annotations

import pytest
import torch

from libkv.landing import RankGroupPool, TPKVPool, checksums_in_parts
from libkv.pool import KVPool
from libkv.rank_channel import InProcessRank
from libkv.transfer import PeerUnreachable, TransferBackend
from libkv.transfer.dp_groups import DPGroupsBackend
from libkv.transfer.tensor_parallel import RankTransfer, TensorParallelBackend
from tests.libkv.transfer.test_tensor_parallel import (  # noqa: F401 (the fixture registers the engine)
    GRANT,
    NUM_PAGES,
    RegionsBackend,
    _regions_engine,
    rank_layout,
    whole_pages,
    worker,
)

OPTIONS = {"timeout_s": 5.0}


class DPWorker:
    """A worker of dp_size groups of attn_tp ranks (world rank order), its rooms placed by hand."""

    def __init__(self, dp_size: int, attn_tp: int, heads: int = 4) -> None:
        layout = rank_layout(heads // attn_tp)
        self.rooms: dict[str, int] = {}
        self.rank_pools = [KVPool(layout, NUM_PAGES) for _ in range(dp_size * attn_tp)]
        channels = [InProcessRank(RankTransfer(pool, rank % attn_tp, attn_tp))
                    for rank, pool in enumerate(self.rank_pools)][1:]  # ranks 1..N-1, as a worker's controls
        groups: list[TransferBackend] = []
        self.views = []
        for g in range(dp_size):
            if g == 0:
                own = channels[:attn_tp - 1]
                pool = TPKVPool(layout, NUM_PAGES, "cpu", own) if own else KVPool(layout, NUM_PAGES)
                pool.buffer = self.rank_pools[0].buffer  # rank 0's pool is the one this process holds
                backend = TensorParallelBackend(RegionsBackend(), own, OPTIONS) if own else RegionsBackend()
            else:
                pool = RankGroupPool(layout, NUM_PAGES, channels[g * attn_tp - 1:(g + 1) * attn_tp - 1])
                backend = TensorParallelBackend.over_ranks(RegionsBackend.name, pool.ranks, OPTIONS)
            backend.register(pool)
            groups.append(backend)
            self.views.append(pool)
        self.attn_tp = attn_tp
        self.backend = DPGroupsBackend(groups, self.rooms.get)

    def group_pools(self, g: int) -> list[KVPool]:
        return self.rank_pools[g * self.attn_tp:(g + 1) * self.attn_tp]


def fill(pools: list[KVPool], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for pool in pools:
        pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=generator))


async def send(sender: TransferBackend, receiver: TransferBackend, room: str, src: list[int],
               dst: list[int]) -> tuple[list[int], int]:
    """The PD services' calls for one room: what the sender checksummed, and its bytes."""
    receiver.expect(room, dst, GRANT)
    peer = sender.connect(receiver.endpoint_for(room))
    sender.verify_grant(peer, dst, key=room, grant=GRANT)
    sent = sender.page_checksums_for(peer, src, key=room)
    handle = sender.write(peer, src, dst, key=room, grant=GRANT)
    await sender.wait(handle)
    receiver.release_expectation(room)
    return sent, handle.nbytes


@pytest.mark.parametrize(("dp_size", "attn_tp"), [(2, 1), (2, 2)])
async def test_a_room_lands_in_its_group_only_from_its_group(dp_size, attn_tp):
    sender, receiver = DPWorker(dp_size, attn_tp), DPWorker(dp_size, attn_tp)
    fill(sender.rank_pools, seed=1)
    before = [whole_pages(receiver.group_pools(g)).clone() for g in range(dp_size)]
    # room-a prefilled on sender group 1, reserved on receiver group 0; room-b the other way round
    sender.rooms.update({"room-a": 1, "room-b": 0})
    receiver.rooms.update({"room-a": 0, "room-b": 1})
    sent_a, nbytes = await send(sender.backend, receiver.backend, "room-a", [1, 2], [5, 6])
    sent_b, _ = await send(sender.backend, receiver.backend, "room-b", [3], [5])
    assert nbytes == 2 * rank_layout(4).page_nbytes
    got = [whole_pages(receiver.group_pools(g)) for g in range(dp_size)]
    assert torch.equal(got[0][[5, 6]], whole_pages(sender.group_pools(1))[[1, 2]])
    assert torch.equal(got[1][[5]], whole_pages(sender.group_pools(0))[[3]])
    assert torch.equal(got[0][[p for p in range(NUM_PAGES) if p not in (5, 6)]],
                       before[0][[p for p in range(NUM_PAGES) if p not in (5, 6)]])
    assert torch.equal(got[1][[p for p in range(NUM_PAGES) if p != 5]],
                       before[1][[p for p in range(NUM_PAGES) if p != 5]])
    # decode's landing check over the room's group's pool view equals what prefill sent
    assert checksums_in_parts(receiver.views[0], [5, 6], attn_tp) == sent_a
    assert checksums_in_parts(receiver.views[1], [5], attn_tp) == sent_b
    assert sum(sender.backend.rank_bytes()) == 3 * rank_layout(4).page_nbytes
    assert len(sender.backend.rank_bytes()) == dp_size * attn_tp


@pytest.mark.parametrize(("sender_tp", "receiver_tp"), [(1, None), (2, None), (None, 1), (None, 2)])
async def test_dp_groups_pair_with_plain_tp_workers(sender_tp, receiver_tp):
    """None: a worker of 2 DP groups of one rank each (the other side is a plain TP worker)."""
    dp_sender, dp_receiver = DPWorker(2, 1), DPWorker(2, 1)
    sender, sender_pools = (worker(sender_tp) if sender_tp else (dp_sender.backend, dp_sender.group_pools(1)))
    receiver, receiver_pools = (worker(receiver_tp) if receiver_tp else (dp_receiver.backend,
                                                                        dp_receiver.group_pools(1)))
    dp_sender.rooms["room"], dp_receiver.rooms["room"] = 1, 1
    fill(sender_pools, seed=2)
    sent, _ = await send(sender, receiver, "room", [0, 4], [7, 8])
    assert torch.equal(whole_pages(receiver_pools)[[7, 8]], whole_pages(sender_pools)[[0, 4]])
    view = receiver_pools[0] if receiver_tp else dp_receiver.views[1]
    assert checksums_in_parts(view, [7, 8], sender_tp or 1) == sent


def test_a_room_on_no_group_is_refused_and_a_late_release_reaches_its_group():
    dp = DPWorker(2, 1)
    with pytest.raises(KeyError, match="room 'ghost' is on no DP attention group"):
        dp.backend.expect("ghost", [1], GRANT)
    dp.rooms["room"] = 1
    dp.backend.expect("room", [1, 2], GRANT)
    assert dp.backend.expected_pages("room") == frozenset({1, 2})
    del dp.rooms["room"]  # the engine forgot the room (released) before the expectation was
    dp.backend.release_expectation("room")
    assert dp.backend.expected_pages("room") == frozenset()
    assert dp.backend.groups[1].expected_pages("room") == frozenset()


def test_a_peer_one_group_cannot_connect_to_leaves_no_link_in_the_others():
    dp = DPWorker(2, 1)
    receiver, _ = worker(1)
    first, second = dp.backend.groups
    second.connect = lambda endpoint: (_ for _ in ()).throw(PeerUnreachable("group 1 cannot reach it"))
    with pytest.raises(PeerUnreachable, match="group 1 cannot reach it"):
        dp.backend.connect(receiver.endpoint())
    assert not first._peers and not dp.backend._peers
