"""Where the engine thread's time goes, by kind of step: the serving-cost account's engine side.

A step is one scheduled forward pass with its sampling and emitting (`Engine.step`). Its kind:
- `decode`: decode rows only;
- `mixed`: decode rows and prompt chunks (running requests wait for the chunk: the prefill's share
  that lands on their tokens);
- `prefill`: prompt chunks only (no request was decoding, so no token waited for it).

Per step it also adds, for the decode rows it ran, the step's seconds once per row: a decode row's
token waited for the whole step. `tools/bench/serving/account.py` reads those totals
(pdserve:engine_decode_token_seconds_total and pdserve:engine_decode_tokens_total) before and after
a run: their ratio is the mean, over the decoded tokens, of the step that produced each one: the TPOT
the requests would have if they paid only the engine (its decode steps and the prompt chunks that ran
inside them). Weighting by tokens, not steps, matters: steps with few decode rows (a batch filling up
while long prompt chunks run) are slow but few tokens wait for them. The gap to the measured TPOT is
what the gateway, gRPC, detokenizing and the event loops cost between the engine and the client.
"""

from __future__ import annotations

KINDS = ("decode", "mixed", "prefill")


class StepClock:
    """Running totals per kind; written by the engine thread only, read by metrics at any time
    (a float or int read is atomic, so a reader is at most one step behind)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(KINDS, 0.0)
        self.steps = dict.fromkeys(KINDS, 0)
        self.decode_tokens = 0  # decode rows over every step
        self.decode_token_seconds = 0.0  # each decode row's step seconds, summed

    @staticmethod
    def kind_of(num_decodes: int, num_extends: int) -> str:
        if num_decodes and num_extends:
            return "mixed"
        return "decode" if num_decodes else "prefill"

    def record(self, kind: str, seconds: float, decode_rows: int = 0) -> None:
        self.seconds[kind] += seconds
        self.steps[kind] += 1
        self.decode_tokens += decode_rows
        self.decode_token_seconds += seconds * decode_rows
