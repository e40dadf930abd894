"""Where the engine thread's time goes, by kind of step: the serving-cost account's engine side.

A step is one scheduled forward pass with its sampling and emitting (`Engine.step`). Its kind:
- `decode`: decode rows only;
- `mixed`: decode rows and prompt chunks (running requests wait for the chunk: the prefill's share
  that lands on their tokens);
- `prefill`: prompt chunks only (no request was decoding, so no token waited for it).

`tools/bench/serving/account.py` reads the totals (pdserve:engine_step_seconds_total and
pdserve:engine_steps_total) before and after a run: a decoding request's tokens cannot come faster
than (decode + mixed seconds) / (decode + mixed steps), the TPOT it would have if it paid only the
engine. The gap to the measured TPOT is what the gateway, gRPC, detokenizing and the event loops
cost between the engine and the client.
"""

from __future__ import annotations

KINDS = ("decode", "mixed", "prefill")


class StepClock:
    """Running totals per kind; written by the engine thread only, read by metrics at any time
    (a float or int read is atomic, so a reader is at most one step behind)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(KINDS, 0.0)
        self.steps = dict.fromkeys(KINDS, 0)

    @staticmethod
    def kind_of(num_decodes: int, num_extends: int) -> str:
        if num_decodes and num_extends:
            return "mixed"
        return "decode" if num_decodes else "prefill"

    def record(self, kind: str, seconds: float) -> None:
        self.seconds[kind] += seconds
        self.steps[kind] += 1
