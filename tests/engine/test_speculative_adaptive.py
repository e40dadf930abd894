"""How much the engine drafts: the draft length an acceptance rate pays for, the engine-wide gate
that stops a poor drafter (probing at doubling intervals), new requests that start from the engine's
rate, requests that keep drafting on their own evidence, and steps with no draft left untouched."""

from __future__ import annotations

from types import SimpleNamespace

from engine.sampling import SamplingParams
from engine.scheduler import Request, ScheduledChunk, SchedulerOutput
from engine.speculative.adaptive import FIRST_PAUSE, MAX_PAUSE, EngineAcceptance, Gate, draft_length
from engine.speculative.config import SpeculativeConfig
from engine.speculative.speculator import DraftPolicy, Speculator

GREEDY = SamplingParams(temperature=0, max_new_tokens=1000)
NGRAM = SpeculativeConfig(speculative_algorithm="NGRAM", speculative_num_draft_tokens=5)


def test_draft_length_is_the_longest_whose_last_draft_still_pays() -> None:
    assert draft_length(0.0, 0.2, 4) == 0
    assert draft_length(0.2, 0.2, 4) == 0  # accepted as often as it costs: no gain
    assert draft_length(0.62, 0.2, 4) == 3  # 0.62, 0.38, 0.24 > 0.2; 0.15 is not
    assert draft_length(0.3, 0.05, 4) == 2
    assert draft_length(1.0, 0.2, 4) == 4


def test_a_poor_drafter_closes_the_gate_and_is_probed_at_doubling_intervals() -> None:
    acceptance = EngineAcceptance(cost=0.2, max_drafts=4)
    assert acceptance.gate() is Gate.OPEN and acceptance.start_length() == 2  # 0.5, 0.25 > 0.2
    for _ in range(16):  # one batch of rejected verifies
        acceptance.record(drafted=2, accepted=0)
    assert not acceptance.worth_drafting
    gates = [acceptance.gate() for _ in range(400)]
    probes = [i for i, gate in enumerate(gates) if gate is Gate.PROBE]
    assert gates[0] is Gate.CLOSED
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert probes[0] == FIRST_PAUSE - 1 and gaps[:5] == [8, 16, 32, 64, 128] and set(gaps[5:]) == {MAX_PAUSE}
    # a probe that finds an accepted draft brings the next one back soon; enough of them reopen the gate
    acceptance.record(drafted=1, accepted=1)
    gates = [acceptance.gate() for _ in range(FIRST_PAUSE)]
    assert gates[-1] is Gate.PROBE
    for _ in range(30):
        acceptance.record(drafted=1, accepted=1)
    assert acceptance.gate() is Gate.OPEN and acceptance.start_length() == 4


class _Counting:
    """A drafter that proposes `n` tokens that are never right, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, request: Request, n: int) -> list[int]:
        self.calls += 1
        return [7] * n


def _speculator(rooms: list[str], drafter) -> tuple[Speculator, dict[str, Request]]:
    requests = {room: Request(room, [1, 2, 3, 4], 3, num_computed=3) for room in rooms}
    scheduler = SimpleNamespace(requests=requests, running=list(requests.values()))
    pages = SimpleNamespace(grow=lambda *args, **kwargs: True)
    return Speculator(NGRAM, scheduler, pages, drafter), requests  # type: ignore[arg-type]


def _step(speculator: Speculator, requests: dict[str, Request], accepted: dict[str, int] | None = None
          ) -> SchedulerOutput:
    """One step: propose over a decode row per request, then settle each verify with `accepted`
    of its drafts right (none by default)."""
    batch = SchedulerOutput(decodes=[ScheduledChunk(room=r.room, token_ids=[r.token_ids[-1]], start_pos=3,
                                                    page_ids=[], sample=True) for r in requests.values()])
    speculator.propose(batch, lambda request: DraftPolicy(100, GREEDY))
    for chunk in batch.extends:
        right = (accepted or {}).get(chunk.room, 0)
        drafts = chunk.token_ids[1:]
        speculator.accept(chunk, drafts[:right] + [0] * (len(drafts) + 1 - right))
    return batch


def test_rows_of_a_poor_drafter_stay_plain_decodes_and_new_requests_start_from_its_rate() -> None:
    drafter = _Counting()
    speculator, requests = _speculator([f"r{i}" for i in range(16)], drafter)
    first = _step(speculator, requests)
    assert [c.num_drafts for c in first.extends] == [4] * 16  # NGRAM before any verify: 0.5**4 > 0.05
    opened = 0
    while speculator.acceptance.worth_drafting:  # a few steps of rejected drafts bring its rate down
        _step(speculator, requests)
        opened += 1
    assert opened < 4
    verify_steps = []
    for step in range(200):
        batch = _step(speculator, requests)
        if batch.extends:
            verify_steps.append(step)
            assert all(c.num_drafts == 1 for c in batch.extends)  # probes: one draft each
        else:
            assert len(batch.decodes) == 16  # the batch goes through untouched
    assert len(verify_steps) <= 6  # probes at 4, 8, 16, 32, 64, 128 steps' distance
    calls = drafter.calls
    _step(speculator, requests)  # a closed step does not even ask the drafter
    assert drafter.calls == calls
    # a request that starts now has no evidence of its own: it waits for the engine's probes too
    new, _ = _speculator(["late"], drafter)
    new.acceptance = speculator.acceptance
    assert not _step(new, {"late": Request("late", [1, 2, 3, 4], 3, num_computed=3)}).extends


def test_a_request_whose_drafts_are_accepted_keeps_drafting_while_the_gate_is_closed() -> None:
    speculator, requests = _speculator(["copy", "other"], _Counting())
    speculator.acceptance.rate = 0.0  # the engine learned (from other requests) that drafts are not accepted
    lengths = []
    for _ in range(140):
        batch = _step(speculator, requests, accepted={"copy": 100})  # "copy"'s drafts are always right
        lengths.append({c.room: c.num_drafts for c in batch.extends})
    probed = next(i for i, rows in enumerate(lengths) if rows)
    # after its first probe, "copy" drafts every step, growing to the most; "other" rarely drafts
    assert all("copy" in rows for rows in lengths[probed:])
    assert lengths[-1]["copy"] == NGRAM.max_drafts
    assert sum("other" in rows for rows in lengths) < 20  # probes, then its own pauses
