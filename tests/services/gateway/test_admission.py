"""AdmissionQueue: exact slot counts, FIFO order, shedding, and no slot leaked on any way out."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.errors import GatewayError
from services.gateway.middleware import AdmissionLimits, AdmissionQueue


def make_queue(max_running: int = 4, max_waiting: int = 2,
               timeout_s: float = 60.0) -> tuple[AdmissionQueue, list]:
    shed: list[tuple[str, str]] = []
    limits = AdmissionLimits(max_running=max_running, max_waiting=max_waiting, queue_timeout_s=timeout_s,
                             retry_after_s=3)
    return AdmissionQueue("m", limits, lambda model, reason: shed.append((model, reason))), shed


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_slots_are_taken_and_given_back() -> None:
    queue, _ = make_queue()
    first = await queue.acquire(3)
    second = await queue.acquire(1)
    assert queue.running == 4 and queue.waiting == 0
    first.release()
    first.release()  # idempotent
    assert queue.running == 1
    second.release()
    assert queue.running == 0


async def test_a_request_bigger_than_the_budget_runs_alone() -> None:
    queue, _ = make_queue(max_running=4)
    ticket = await queue.acquire(100)
    assert ticket.slots == 4 and queue.running == 4
    ticket.release()
    assert queue.running == 0


async def test_waiters_are_admitted_in_order_and_the_head_is_not_overtaken() -> None:
    queue, _ = make_queue(max_running=4, max_waiting=3)
    holder = await queue.acquire(3)
    big = asyncio.create_task(queue.acquire(4))
    await settle()
    small = asyncio.create_task(queue.acquire(1))  # one slot is free, but the big one is first
    await settle()
    assert queue.waiting == 2 and not big.done() and not small.done()
    holder.release()
    await settle()
    assert big.done() and not small.done() and queue.running == 4
    big.result().release()
    await settle()
    assert small.done() and queue.running == 1
    small.result().release()
    assert queue.running == 0 and queue.waiting == 0


async def test_a_full_queue_sheds_with_429_and_retry_after() -> None:
    queue, shed = make_queue(max_running=1, max_waiting=1)
    holder = await queue.acquire(1)
    waiter = asyncio.create_task(queue.acquire(1))
    await settle()
    with pytest.raises(GatewayError) as refused:
        await queue.acquire(1)
    assert refused.value.status == 429 and refused.value.headers == {"Retry-After": "3"}
    assert refused.value.code == "server_overloaded"
    assert shed == [("m", "queue_full")]
    holder.release()
    (await waiter).release()
    assert queue.running == 0


async def test_a_wait_longer_than_the_timeout_is_shed_and_leaves_the_queue() -> None:
    queue, shed = make_queue(max_running=1, max_waiting=1, timeout_s=0.01)
    holder = await queue.acquire(1)
    with pytest.raises(GatewayError) as refused:
        await queue.acquire(1)
    assert refused.value.status == 429 and shed == [("m", "queue_timeout")]
    assert queue.waiting == 0
    holder.release()
    assert queue.running == 0


async def test_a_cancelled_waiter_leaves_the_queue_and_lets_the_next_one_in() -> None:
    queue, _ = make_queue(max_running=2, max_waiting=2)
    holder = await queue.acquire(1)
    big = asyncio.create_task(queue.acquire(2))  # the head: needs both slots
    await settle()
    small = asyncio.create_task(queue.acquire(1))  # fits now, but waits behind the head
    await settle()
    assert not small.done()
    big.cancel()  # the client behind the head hung up
    await settle()
    assert big.cancelled() and small.done() and queue.waiting == 0 and queue.running == 2
    small.result().release()
    holder.release()
    assert queue.running == 0


async def test_slots_granted_to_a_waiter_cancelled_at_that_moment_are_not_lost() -> None:
    queue, _ = make_queue(max_running=1, max_waiting=1)
    holder = await queue.acquire(1)
    waiter = asyncio.create_task(queue.acquire(1))
    await settle()
    holder.release()  # grants the slot to the waiter (its future is done) ...
    waiter.cancel()  # ... and the waiter is cancelled before it runs again
    try:
        ticket = await waiter  # Python 3.11's wait_for returns the result it already had
    except asyncio.CancelledError:
        ticket = None  # later versions raise: the slot must have gone back
    assert queue.running == (1 if ticket is not None else 0) and queue.waiting == 0
    if ticket is not None:
        ticket.release()
    assert queue.running == 0
