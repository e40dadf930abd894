"""Prefill's transfer queues: KV writes are issued off the engine thread, sharded by room.

Mirrors SGLang's knobs: PDSERVE_DISAGGREGATION_QUEUE_SIZE queues share
PDSERVE_DISAGGREGATION_THREAD_POOL_SIZE threads; a room always uses the same queue, so its writes
are issued in order while requests of other rooms (and other decode peers) proceed in parallel.
The engine thread only enqueues, so a slow transfer-engine call never stalls the forward loop.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class TransferQueues:
    """`num_queues` executors with `thread_pool_size` threads between them (at least one each)."""

    def __init__(self, num_queues: int, thread_pool_size: int) -> None:
        if num_queues < 1 or thread_pool_size < 1:
            raise ValueError(f"transfer queues need >= 1 queue and thread, got {num_queues} and {thread_pool_size}")
        per_queue = max(1, thread_pool_size // num_queues)
        self._queues = [ThreadPoolExecutor(per_queue, thread_name_prefix=f"pdserve-transfer-{i}")
                        for i in range(num_queues)]

    def submit(self, room: str, fn: Callable[[], T]) -> Future[T]:
        # crc32, not hash(): stable across processes, so logs and tests can predict the queue.
        return self._queues[zlib.crc32(room.encode()) % len(self._queues)].submit(fn)

    def shutdown(self) -> None:
        for queue in self._queues:
            queue.shutdown(wait=True, cancel_futures=True)
