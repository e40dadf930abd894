"""Workers with pipeline stages, in one process (GQA and MLA pages): each world rank's pool holds
its stage's layers, rank r writes whole pages into rank r of a peer of the same (tp, pp) layout,
both sides agree on the page checksums, and the worker's endpoint has the whole model's layout
(every layer, every KV head). A peer of another --pp-size, or of another --tp-size under stages,
is refused in connect() naming both values, before any byte moves.

Same in-process engine and rank channels as tests.libkv.transfer.test_tensor_parallel.
"""

from __future__ import annotations

import pytest
import torch

from libkv.landing import TPKVPool, checksums_in_parts
from libkv.layout import KVLayout, LayoutMismatch
from libkv.pool import KVPool
from libkv.rank_channel import InProcessRank
from libkv.transfer import TransferBackend, TransferState
from libkv.transfer.tensor_parallel import RankTransfer, TensorParallelBackend
from tests.libkv.transfer.test_tensor_parallel import (
    GRANT,
    NUM_PAGES,
    RegionsBackend,
    _regions_engine,
    worker,
)

__all__ = ["_regions_engine"]  # the fixture that lets followers make RegionsBackends by name

STAGE_LAYERS = [2, 1]  # a 3-layer model in 2 stages: the first stage one layer longer


def stage_layout(layers: int, tp: int, mla: bool) -> KVLayout:
    """One rank's page: its stage's layers, and 4 // tp KV heads (MLA: the whole latent)."""
    if mla:
        return KVLayout.mla(num_layers=layers, kv_lora_rank=4, qk_rope_head_dim=2, page_size=2,
                            dtype="float32")
    return KVLayout(num_layers=layers, num_kv_heads=4 // tp, head_dim=4, page_size=2, dtype="float32")


def staged_worker(tp: int, mla: bool = False) -> tuple[TransferBackend, list[KVPool]]:
    """A worker of 2 stages of `tp` ranks each (world rank order) and its ranks' pools."""
    layouts = [stage_layout(STAGE_LAYERS[rank // tp], tp, mla) for rank in range(2 * tp)]
    followers = [RankTransfer(KVPool(layouts[rank], NUM_PAGES), rank, 2 * tp, pp_size=2)
                 for rank in range(1, 2 * tp)]
    channels = [InProcessRank(follower) for follower in followers]
    pool = TPKVPool(layouts[0], NUM_PAGES, "cpu", channels)
    backend = TensorParallelBackend(RegionsBackend(timeout_s=5.0), channels, {"timeout_s": 5.0}, pp_size=2)
    backend.register(pool)
    return backend, [pool, *(follower.pool for follower in followers)]


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
@pytest.mark.parametrize("tp", [1, 2])
async def test_each_rank_writes_its_stage_pages_to_the_same_rank(tp, mla):
    sender, sender_pools = staged_worker(tp, mla)
    receiver, receiver_pools = staged_worker(tp, mla)
    endpoint = receiver.endpoint()
    assert endpoint.pp_size() == 2 and len(endpoint.ranks()) == 2 * tp
    # the whole model: every layer, every KV head (MLA: the one latent)
    assert (endpoint.layout.num_layers, endpoint.layout.num_kv_heads) == (3, 1 if mla else 4)
    generator = torch.Generator().manual_seed(tp)
    for pool in sender_pools:
        pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=generator))
    src, dst = [1, 2, 3, 7], [4, 5, 9, 0]
    before = [pool.buffer.clone() for pool in receiver_pools]
    receiver.expect("room-1", dst, GRANT)
    peer = sender.connect(endpoint)
    sender.verify_grant(peer, dst, key="room-1", grant=GRANT)
    sent = sender.page_checksums_for(peer, src)
    handle = sender.write(peer, src, dst, key="room-1", grant=GRANT)
    await sender.wait(handle)
    assert sender.poll(handle) is TransferState.DONE
    untouched = [page for page in range(NUM_PAGES) if page not in dst]
    for rank, (mine, theirs, old) in enumerate(zip(sender_pools, receiver_pools, before, strict=True)):
        assert torch.equal(theirs.buffer[dst], mine.buffer[src]), f"rank {rank}"
        assert torch.equal(theirs.buffer[untouched], old[untouched]), f"rank {rank}"
    # decode's landing check (it is told the prefill's --tp-size) computes what prefill sent
    assert checksums_in_parts(receiver_pools[0], dst, tp) == sent
    assert sum(sender.rank_bytes()) == handle.nbytes \
        == len(src) * sum(p.layout.page_nbytes for p in sender_pools)


def test_other_pp_size_is_refused_naming_both():
    staged, _ = staged_worker(1)
    flat, _ = worker(2, RegionsBackend)  # the same world size, no stages
    with pytest.raises(LayoutMismatch, match=r"--pp-size 2 \(prefill\) vs --pp-size 1 \(decode\)"):
        staged.connect(flat.endpoint())
    with pytest.raises(LayoutMismatch, match=r"--pp-size 1 \(prefill\) vs --pp-size 2 \(decode\)"):
        flat.connect(staged.endpoint())


def test_other_tp_size_under_stages_is_refused_naming_both():
    small, _ = staged_worker(1)
    big, _ = staged_worker(2)
    with pytest.raises(LayoutMismatch,
                       match=r"--tp-size 1 \(prefill\) vs --tp-size 2 \(decode\) at --pp-size 2"):
        small.connect(big.endpoint())
