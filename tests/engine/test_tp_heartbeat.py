"""engine.tp.rendezvous.HeartbeatWatch: a peer that stops beating is lost after the timeout, while one
that has not beaten yet (rank 0 beats only once its group has joined) gets the longer first-beat
timeout, so a slow start on a loaded machine is not taken for a lost node."""

from __future__ import annotations

import threading
import time

import pytest

from engine.tp import rendezvous
from engine.tp.rendezvous import HeartbeatWatch


class CounterStore:
    """The store calls HeartbeatWatch makes: add(key, n) returns the counter after adding."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()

    def add(self, key: str, amount: int) -> int:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + amount
            return self.counts[key]


@pytest.fixture(autouse=True)
def fast_beats(monkeypatch) -> None:
    monkeypatch.setattr(rendezvous, "HEARTBEAT_INTERVAL_S", 0.02)


def _watch(store: CounterStore, **first_beat) -> tuple[HeartbeatWatch, list[str]]:
    lost: list[str] = []
    return HeartbeatWatch(store, "node 1", ["tp rank 0"], 0.3, lost.append, **first_beat), lost  # type: ignore[arg-type]


def _wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_a_peer_that_has_not_beaten_yet_gets_the_first_beat_timeout() -> None:
    store = CounterStore()
    watch, lost = _watch(store, first_beat_timeout_s=60.0)
    try:
        time.sleep(1.0)  # more than three timeouts without a first beat: still starting, not lost
        assert lost == []
        for _ in range(5):  # it starts beating ...
            store.add("pdserve:heartbeat:tp rank 0", 1)
            time.sleep(0.05)
        assert lost == []
        # ... and then stops: lost after the ordinary timeout
        assert _wait_for(lambda: lost == ["tp rank 0 sent no heartbeat for 0s"]), lost
    finally:
        watch.stop()
    assert store.counts["pdserve:heartbeat:node 1"] > 0  # it beat itself meanwhile


def test_without_a_first_beat_timeout_a_silent_peer_is_lost_after_the_timeout() -> None:
    store = CounterStore()
    watch, lost = _watch(store)
    try:
        assert _wait_for(lambda: lost == ["tp rank 0 sent no heartbeat for 0s"]), lost
    finally:
        watch.stop()
