"""Scheduler and PageManager behaviour, exact and without a model: the engine loop is simulated
by `run_step` (advance computed tokens, append token 7 to every sampled request)."""

from __future__ import annotations

import pytest

from engine.page_manager import PageManager
from engine.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig, SchedulerOutput


def make(num_pages=16, page_size=4, chunk=32, max_running=8, max_seq_len=1000) -> Scheduler:
    return Scheduler(SchedulerConfig(max_running_requests=max_running, chunked_prefill_size=chunk,
                                     max_seq_len=max_seq_len), PageManager(num_pages, page_size))


def request(room: str, prompt_len: int) -> Request:
    return Request(room=room, token_ids=list(range(100, 100 + prompt_len)), num_prompt=prompt_len)


def run_step(scheduler: Scheduler) -> SchedulerOutput:
    batch = scheduler.schedule()
    scheduler.advance(batch)
    for chunk in batch.sampled_chunks():
        scheduler.requests[chunk.room].token_ids.append(7)
    return batch


def spans(batch: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(c.room, c.start_pos, c.end_pos, c.sample) for c in batch.decodes + batch.extends]


def test_long_prompt_spans_steps_with_pages_allocated_up_front():
    scheduler = make(num_pages=64, chunk=32)
    scheduler.add(request("a", 100))
    batch = run_step(scheduler)
    assert spans(batch) == [("a", 0, 32, False)]
    assert scheduler.requests["a"].page_ids == list(range(25))  # 100 tokens / 4, lowest ids first
    assert spans(run_step(scheduler)) == [("a", 32, 64, False)]
    assert spans(run_step(scheduler)) == [("a", 64, 96, False)]
    assert spans(run_step(scheduler)) == [("a", 96, 100, True)]
    batch = run_step(scheduler)  # decode of the sampled token; a 26th page for position 100
    assert spans(batch) == [("a", 100, 101, True)] and batch.extends == []
    assert scheduler.requests["a"].page_ids == list(range(26))


def test_budget_is_shared_and_decodes_ride_along():
    scheduler = make(num_pages=64, chunk=32)
    scheduler.add(request("a", 20))
    scheduler.add(request("b", 30))
    assert spans(run_step(scheduler)) == [("a", 0, 20, True), ("b", 0, 12, False)]
    scheduler.add(request("c", 5))
    # a decodes; b finishes its prompt; c gets the remaining 14 of the budget.
    assert spans(run_step(scheduler)) == [("a", 20, 21, True), ("b", 12, 30, True), ("c", 0, 5, True)]
    assert spans(run_step(scheduler)) == [("a", 21, 22, True), ("b", 30, 31, True), ("c", 5, 6, True)]


def test_max_running_requests():
    scheduler = make(num_pages=64, max_running=2)
    for room in "abc":
        scheduler.add(request(room, 3))
    assert [c.room for c in run_step(scheduler).extends] == ["a", "b"]
    assert [r.room for r in scheduler.waiting] == ["c"]
    scheduler.finish(scheduler.requests["a"], "stop")
    batch = run_step(scheduler)
    assert [c.room for c in batch.decodes] == ["b"] and [c.room for c in batch.extends] == ["c"]


def test_admission_waits_for_pages_and_keeps_slack():
    scheduler = make(num_pages=10, page_size=4)
    scheduler.add(request("a", 16))  # 4 pages
    run_step(scheduler)
    scheduler.add(request("b", 21))  # 6 pages: would leave 0 free, less than 1 page of slack for a
    batch = run_step(scheduler)
    assert [c.room for c in batch.extends] == [] and [r.room for r in scheduler.waiting] == ["b"]
    scheduler.finish(scheduler.requests["a"], "length")
    assert spans(run_step(scheduler)) == [("b", 0, 21, True)]


def test_retraction_frees_newest_and_resumes_with_generated_tokens():
    scheduler = make(num_pages=6, page_size=4)
    scheduler.add(request("a", 8))
    scheduler.add(request("b", 3))
    run_step(scheduler)  # a: pages 0,1 (tokens 0-7), b: page 2; 3 free
    assert scheduler.pages.free_pages == 3
    # Decode until the pool runs dry: a needs a page at positions 8, 12; b at 4, 8.
    while scheduler.num_retractions == 0:
        run_step(scheduler)
    b = scheduler.requests["b"]
    assert b.status is RequestStatus.WAITING and b.page_ids == [] and b.num_computed == 0
    assert scheduler.waiting[0] is b and b.num_retractions == 1
    generated = b.num_generated
    assert generated > 0
    # b comes back once a finishes; its chunk recomputes prompt + generated tokens and samples.
    scheduler.finish(scheduler.requests["a"], "length")
    assert spans(run_step(scheduler)) == [("b", 0, 3 + generated, True)]
    assert b.token_ids[:3] == [100, 101, 102]


def test_retraction_never_takes_prefill_only_requests():
    scheduler = make(num_pages=4, page_size=4, chunk=4)
    decoder = request("d", 9)  # 8 prompt tokens computed, 1 sampled: its next decode needs a 3rd page
    decoder.num_computed = 8
    decoder.page_ids = scheduler.pages.allocator.allocate(2)
    scheduler.add_running(decoder)
    prefill = request("p", 8)
    prefill.prefill_only = True
    prefill.page_ids = scheduler.pages.allocator.allocate(2)
    scheduler.add_running(prefill)  # newer than d, but its pages may already be in flight to decode
    batch = run_step(scheduler)
    assert decoder.status is RequestStatus.WAITING and decoder.page_ids == []
    assert spans(batch) == [("p", 0, 4, False)]


def test_prefill_only_pages_are_held_until_released():
    scheduler = make(num_pages=8)
    prefill = request("p", 10)
    prefill.prefill_only = True
    scheduler.add(prefill)
    run_step(scheduler)
    scheduler.finish(prefill, "stop")
    assert scheduler.pages.used_pages == 3 and scheduler.pages.has_room("p")
    assert scheduler.pages.release("p") and scheduler.pages.used_pages == 0
    assert not scheduler.pages.release("p")


def test_abort_waiting_and_running():
    scheduler = make(num_pages=8, max_running=1)
    scheduler.add(request("a", 5))
    scheduler.add(request("b", 5))
    run_step(scheduler)
    assert scheduler.abort("b").finish_reason == "abort" and not scheduler.waiting
    assert scheduler.abort("a").finish_reason == "abort" and not scheduler.running
    assert scheduler.abort("a") is None
    assert scheduler.pages.used_pages == 0


def test_check_fits():
    scheduler = make(num_pages=4, page_size=4, max_seq_len=100)
    scheduler.check_fits(10, 6)
    with pytest.raises(ValueError, match="KV pool"):
        scheduler.check_fits(10, 7)
    with pytest.raises(ValueError, match="context"):
        scheduler.check_fits(100, 1)
    with pytest.raises(ValueError, match="at least one token"):
        scheduler.check_fits(0, 1)


def test_page_manager_reservations():
    pages = PageManager(num_pages=8, page_size=4)
    assert pages.reserve("r", 9) == [0, 1, 2]
    assert pages.reserve("s", 30) is None  # 8 pages needed, 5 free
    with pytest.raises(ValueError):
        pages.reserve("r", 1)
    owned = pages.take_reserved("r")
    assert owned == [0, 1, 2] and not pages.has_room("r") and pages.used_pages == 3
    assert pages.grow(owned, 17) and owned == [0, 1, 2, 3, 4]
    assert not pages.grow(owned, 29, keep_free=2) and len(owned) == 5
    pages.free(owned)
    assert owned == [] and pages.used_pages == 0
