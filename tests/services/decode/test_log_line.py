"""The decode worker's "Decode batch" line: SGLang's `accept len` appears when verifies ran since the
previous line, and is the mean tokens one verify yielded."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from engine.outputs import EngineStats
from services.decode.log_line import DecodeLogLine

IDLE = EngineStats(waiting=0, running=0, retracted=0, total_retractions=0, used_pages=0, total_pages=10,
                   held_rooms=0, reserved_pages=0, running_tokens=0, generated_tokens=0, steps=0)


class _Runtime:
    def __init__(self) -> None:
        self.stats = IDLE
        self.engine = SimpleNamespace(stats=lambda: self.stats)

    def queue_counts(self, stats: EngineStats) -> dict[str, int]:
        return {"prealloc": 0, "transfer": 0}


def test_accept_len_is_the_tokens_per_verify_since_the_last_line() -> None:
    runtime = _Runtime()
    line = DecodeLogLine(runtime)  # type: ignore[arg-type]
    runtime.stats = replace(IDLE, running=1, generated_tokens=10, spec_drafted_tokens=12,
                            spec_accepted_tokens=6, spec_verify_rows=4)
    first = line.next()
    assert first is not None and "accept len: 2.50, cuda graph: False, gen throughput (token/s): " in first
    runtime.stats = replace(runtime.stats, generated_tokens=12, spec_accepted_tokens=7, spec_verify_rows=5)
    second = line.next()
    assert second is not None and "accept len: 2.00, " in second
    runtime.stats = replace(runtime.stats, generated_tokens=13)  # a plain decode step: no verify
    third = line.next()
    assert third is not None and "accept len" not in third
