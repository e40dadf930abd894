"""Circuit breaker of one worker: stop sending traffic to a worker that keeps failing.

States (the router asks `available()` before choosing a worker, and reports each outcome):

    CLOSED     traffic flows; `failure_threshold` failures in a row -> OPEN
    OPEN       no traffic for `cooldown_s`; then -> HALF_OPEN (checked lazily on the next query)
    HALF_OPEN  one trial at a time: the router takes the slot with `acquire()`; a success (or a
               passing health probe) -> CLOSED, a failure -> OPEN again with a fresh cool-down

Only failures that say something about the worker count (UNAVAILABLE, timeouts); a client's bad
request does not. The clock is injectable so tests drive the state machine exactly.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable


class BreakerState(enum.Enum):
    CLOSED = "closed"
    HALF_OPEN = "half_open"
    OPEN = "open"

    @property
    def gauge_value(self) -> int:
        """The number exported in metrics: 0 closed, 1 half-open, 2 open."""
        return {"closed": 0, "half_open": 1, "open": 2}[self.value]


class CircuitBreaker:
    """Closed/open/half-open state of one worker. Not thread-safe: used from the event loop."""

    def __init__(self, failure_threshold: int = 3, cooldown_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._trial_in_flight = False

    @property
    def state(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.cooldown_s:
            self._state = BreakerState.HALF_OPEN
            self._trial_in_flight = False
        return self._state

    @property
    def consecutive_failures(self) -> int:
        return self._failures

    def available(self) -> bool:
        """May the router send a request now? (HALF_OPEN: only while no trial is in flight.)"""
        state = self.state
        return state is BreakerState.CLOSED or (state is BreakerState.HALF_OPEN and not self._trial_in_flight)

    def acquire(self) -> None:
        """The router chose this worker: in HALF_OPEN this request is the trial."""
        if self.state is BreakerState.HALF_OPEN:
            self._trial_in_flight = True

    def record_success(self) -> None:
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._trial_in_flight = False

    def record_failure(self) -> None:
        state = self.state
        self._failures += 1
        if state is BreakerState.HALF_OPEN or self._failures >= self.failure_threshold:
            self._open()

    def release(self) -> None:
        """A request finished without saying anything about the worker (client abort, bad input):
        free the half-open trial slot without changing state."""
        self._trial_in_flight = False

    def _open(self) -> None:
        self._state = BreakerState.OPEN
        self._opened_at = self._clock()
        self._trial_in_flight = False

    def probe_due(self) -> bool:
        """Is the worker waiting for a probe (half-open with no trial running)?"""
        return self.state is BreakerState.HALF_OPEN and not self._trial_in_flight
