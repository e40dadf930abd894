"""The leak detector, exact, over a real engine's page manager (tiny model)."""

from __future__ import annotations

import pytest

from services.worker.leak_detector import Leak, LeakDetector
from tests.engine.conftest import generate, start_engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from tools.models.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path_factory.mktemp("leak") / "tiny", preset="tiny", seed=0)
    started = start_engine(model, num_pages=64, page_size=16)
    yield started
    started.shutdown()


def detector(engine, live: set[str], found: list[Leak]) -> LeakDetector:
    return LeakDetector(engine, lambda: set(live), found.append)


def test_idle_worker_has_no_leak(engine):
    found: list[Leak] = []
    check = detector(engine, set(), found)
    assert check.check() is None and check.check() is None and found == []


def test_a_reservation_of_a_live_room_is_not_a_leak(engine):
    found: list[Leak] = []
    check = detector(engine, {"room-live"}, found)
    assert engine.reserve("room-live", 40) is not None
    try:
        assert check.check() is None and check.check() is None and found == []
    finally:
        engine.release("room-live")


def test_pages_held_by_a_room_nobody_owns_are_reported_once(engine):
    found: list[Leak] = []
    live = {"room-other"}
    check = LeakDetector(engine, lambda: live, found.append)
    engine.reserve("room-lost", 40)  # 3 pages of 16 tokens
    try:
        assert check.check() is None  # seen once: might be a room finishing right now
        leak = check.check()
        assert leak == Leak(rooms=(("room-lost", 3),), unowned_pages=0)
        assert "room room-lost holds 3 page(s)" in leak.describe()
        check.check()
        assert found == [leak]  # reported once, not every interval
        live.add("room-lost")  # the room is live after all (e.g. quarantined): no longer a leak
        assert check.check() is None
    finally:
        engine.release("room-lost")
    assert check.check() is None and engine.stats().used_pages == 0


def test_pages_in_use_with_no_live_room_and_no_owner_are_reported(engine):
    found: list[Leak] = []
    check = detector(engine, set(), found)
    pages = engine.allocator.allocate(2)  # taken outside any request or reservation
    try:
        check.check()
        assert check.check() == Leak(rooms=(), unowned_pages=2) and len(found) == 1
    finally:
        engine.allocator.release(pages)


async def test_idle_cached_pages_are_not_a_leak_but_a_leaked_reference_on_one_is(engine):
    from engine.sampling import SamplingParams

    found: list[Leak] = []
    check = detector(engine, set(), found)
    prompt = list(range(100, 150))  # 3 full pages stay cached after the request
    async for _ in generate(engine, prompt, SamplingParams(temperature=0, max_new_tokens=2), "cached"):
        pass
    assert engine.stats().cached_pages >= 3 and engine.allocator.idle_pages >= 3
    assert engine.stats().used_pages == 0
    assert check.check() is None and check.check() is None and found == []
    page = engine.allocator.idle_order()[0]
    engine.allocator.retain([page])  # a reference nobody gives back
    try:
        check.check()
        assert check.check() == Leak(rooms=(), unowned_pages=1)
    finally:
        engine.allocator.release([page])
