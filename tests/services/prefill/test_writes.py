"""Prefill's transfer queues (services/prefill/writes.py): a room keeps its queue and order."""

import threading

import pytest

from libkv.landing import checksums_in_parts
from libkv.transfer import BACKENDS
from services.prefill.writes import RoomWrites, TransferQueues
from tests.libkv.transfer.test_mla_tensor_parallel import GRANT, MLA, WholePagesBackend
from tests.libkv.transfer.test_mla_tensor_parallel import worker as mla_worker


def test_a_room_keeps_its_queue_and_order_while_rooms_spread_over_queues():
    queues = TransferQueues(num_queues=4, thread_pool_size=4)
    try:
        threads: dict[str, set[str]] = {}
        order: list[int] = []
        futures = []
        for i in range(20):
            def job(i=i):
                threads.setdefault("room-a", set()).add(threading.current_thread().name)
                order.append(i)
            futures.append(queues.submit("room-a", job))
        other = queues.submit("room-b", lambda: threading.current_thread().name)
        for future in futures:
            future.result(timeout=10)
        assert order == list(range(20))  # one thread per queue: issued in push order
        assert len(threads["room-a"]) == 1
        names = {queues.submit(f"room-{i}",
                               lambda: threading.current_thread().name.rsplit("_", 1)[0]).result()
                 for i in range(64)}
        assert len(names) == 4 and other.result(timeout=10)
    finally:
        queues.shutdown()


def test_needs_a_queue_and_a_thread():
    with pytest.raises(ValueError):
        TransferQueues(0, 4)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1), (2, 2)])
async def test_mla_bytes_pushed_count_each_latent_page_once_per_decode_rank(monkeypatch, prefill_tp,
                                                                           decode_tp):
    # What pdserve:kv_transfer_bytes_total adds per request (RoomWrites.bytes_pushed): the bytes
    # shipped, so bytes / tokens reads off the KV cost per token (MLA: the latent, once per decode rank).
    monkeypatch.setitem(BACKENDS, WholePagesBackend.name, (WholePagesBackend.__module__, "WholePagesBackend"))
    sender, _, _ = mla_worker(prefill_tp)
    receiver, receiver_pools, _ = mla_worker(decode_tp)
    queues = TransferQueues(num_queues=1, thread_pool_size=1)
    try:
        dst = [4, 5, 6]
        receiver.expect("room-1", dst, GRANT)
        writes = RoomWrites("room-1", sender, queues, sender.connect(receiver.endpoint()), dst, grant=GRANT,
                            want_checksums=True)
        writes.push([0, 1], num_tokens=4)  # after a chunk, then the rest
        writes.push([0, 1, 2], num_tokens=5)
        await writes.wait_all()
    finally:
        queues.shutdown()
    assert writes.bytes_pushed == decode_tp * 3 * MLA.page_nbytes
    assert writes.checksums == checksums_in_parts(receiver_pools[0], dst, prefill_tp)
