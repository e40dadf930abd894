"""The circuit breaker's closed / open / half-open state machine, driven by a fake clock."""

from __future__ import annotations

import pytest

from services.gateway.workers import BreakerState, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_opens_after_consecutive_failures_only(clock: Clock) -> None:
    breaker = CircuitBreaker(failure_threshold=3, cooldown_s=10, clock=clock)
    breaker.record_failure()
    breaker.record_failure()
    breaker.record_success()  # resets the streak
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED and breaker.available()
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN and not breaker.available()


def test_half_open_after_cooldown_allows_one_trial(clock: Clock) -> None:
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=10, clock=clock)
    breaker.record_failure()
    clock.now += 9.9
    assert breaker.state is BreakerState.OPEN and not breaker.available()
    clock.now += 0.1
    assert breaker.state is BreakerState.HALF_OPEN and breaker.available() and breaker.probe_due()
    breaker.acquire()  # the trial request
    assert not breaker.available() and not breaker.probe_due()
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED and breaker.available()
    assert breaker.consecutive_failures == 0


def test_failed_trial_reopens_with_a_fresh_cooldown(clock: Clock) -> None:
    breaker = CircuitBreaker(failure_threshold=2, cooldown_s=5, clock=clock)
    breaker.record_failure()
    breaker.record_failure()
    clock.now += 5
    breaker.acquire()
    breaker.record_failure()  # one failure in half-open is enough
    assert breaker.state is BreakerState.OPEN
    clock.now += 4.9
    assert breaker.state is BreakerState.OPEN
    clock.now += 0.1
    assert breaker.state is BreakerState.HALF_OPEN


def test_release_frees_the_trial_slot_without_a_verdict(clock: Clock) -> None:
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=1, clock=clock)
    breaker.record_failure()
    clock.now += 1
    breaker.acquire()
    breaker.release()  # e.g. the client left: says nothing about the worker
    assert breaker.state is BreakerState.HALF_OPEN and breaker.available()


def test_acquire_in_closed_state_changes_nothing(clock: Clock) -> None:
    breaker = CircuitBreaker(clock=clock)
    breaker.acquire()
    breaker.acquire()
    assert breaker.available() and breaker.state is BreakerState.CLOSED


def test_gauge_values_and_bad_threshold() -> None:
    states = (BreakerState.CLOSED, BreakerState.HALF_OPEN, BreakerState.OPEN)
    assert [s.gauge_value for s in states] == [0, 1, 2]
    with pytest.raises(ValueError, match="failure_threshold"):
        CircuitBreaker(failure_threshold=0)
