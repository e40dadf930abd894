"""Prefill's transfer queues (services/prefill/writes.py): a room keeps its queue and order."""

import threading

import pytest

from services.prefill.writes import TransferQueues


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
        names = {queues.submit(f"room-{i}", lambda: threading.current_thread().name.rsplit("_", 1)[0]).result()
                 for i in range(64)}
        assert len(names) == 4 and other.result(timeout=10)
    finally:
        queues.shutdown()


def test_needs_a_queue_and_a_thread():
    with pytest.raises(ValueError):
        TransferQueues(0, 4)
