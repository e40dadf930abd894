"""The simulated engine's parts on their own: the step-time profile, and the runner's tokens (a
function of the context held in the KV pages) and pacing, with a fake clock."""

from __future__ import annotations

import json

import pytest
import torch

from engine.config import EngineConfig
from engine.scheduler import ScheduledChunk, SchedulerOutput
from engine.sim.load import sim_layout
from engine.sim.profile import SimProfile
from engine.sim.runner import HASH_SEED, SimRunner, context_hash, mix
from libkv.pool import KVPool

VOCABULARY = list(range(5, 105))


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def make_runner(profile: SimProfile = SimProfile()) -> tuple[SimRunner, FakeClock]:
    clock = FakeClock()
    pool = KVPool(sim_layout(4), 32)
    return SimRunner(pool, profile, VOCABULARY, 128, clock=clock, sleep=clock.sleep), clock


def picked(logits: torch.Tensor) -> list[int]:
    return logits.argmax(dim=-1).tolist()


def test_profile_interpolates_and_extends_its_table():
    profile = SimProfile(decode_ms=((1, 10.0), (11, 20.0)), prefill_ms=((0, 5.0), (100, 15.0)))
    assert profile.step_seconds(6, 0) == pytest.approx(0.015)
    assert profile.step_seconds(21, 0) == pytest.approx(0.030)  # past the last point, along its segment
    assert profile.step_seconds(1, 50) == pytest.approx(0.020)  # a mixed step pays both
    assert profile.step_seconds(0, 0) == 0.0
    builtin = SimProfile()
    assert builtin.decode_tokens_per_second(100) == pytest.approx(4464, rel=0.01)  # the seeds' pair


def test_profile_file_and_its_errors(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"decode_ms": [[1, 2], [8, 4]], "prefill_ms": [[1, 1], [64, 3]]}))
    assert SimProfile.load(str(good)).decode_ms == ((1.0, 2.0), (8.0, 4.0))
    assert SimProfile.load(None) == SimProfile()
    for body, says in ((["x"], "decode_ms and prefill_ms"),
                       ({"decode_ms": [[1, 2]], "prefill_ms": [[1, 1], [2, 2]]}, "at least two"),
                       ({"decode_ms": [[2, 2], [1, 3]], "prefill_ms": [[1, 1], [2, 2]]}, "increasing"),
                       ({"decode_ms": [[1, -2], [2, 3]], "prefill_ms": [[1, 1], [2, 2]]}, "non-negative")):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(body))
        with pytest.raises(ValueError, match=says):
            SimProfile.load(str(bad))
    with pytest.raises(ValueError, match="sim profile"):
        SimProfile.load(str(tmp_path / "missing.json"))


def test_tokens_follow_the_whole_context_through_the_pages():
    runner, _ = make_runner()
    prompt = [7, 8, 9, 10, 11, 12]
    # a prompt in two chunks, then one decode step: pages 3 and 5 hold its positions
    first = SchedulerOutput(decodes=[], extends=[ScheduledChunk("r", prompt[:4], 0, [3], sample=False)])
    assert runner.forward(first).shape == (0, 128)
    second = SchedulerOutput(decodes=[], extends=[ScheduledChunk("r", prompt[4:], 4, [3, 5], sample=True)])
    token = picked(runner.forward(second))[0]
    assert token == VOCABULARY[context_hash(prompt) % len(VOCABULARY)]
    assert runner.hashes[5, 1].item() == context_hash(prompt)
    step = SchedulerOutput(decodes=[ScheduledChunk("r", [token], 6, [3, 5], sample=True)], extends=[])
    assert picked(runner.forward(step)) == [VOCABULARY[context_hash([*prompt, token]) % len(VOCABULARY)]]
    # pages that never received the prompt (a transfer that moved nothing) give another token
    runner.hashes.zero_()
    assert picked(runner.forward(step)) != [VOCABULARY[context_hash([*prompt, token]) % len(VOCABULARY)]]
    assert mix(HASH_SEED, 7) == context_hash([7])


def test_steps_last_the_modeled_time_and_back_to_back_steps_absorb_overhead():
    profile = SimProfile(decode_ms=((1, 10.0), (2, 10.0)), prefill_ms=((1, 4.0), (2, 4.0)))
    runner, clock = make_runner(profile)
    step = SchedulerOutput(decodes=[ScheduledChunk("r", [9], 1, [0], sample=True)], extends=[])
    runner.hashes[0, 0] = float(HASH_SEED)
    runner.forward(step)
    assert sum(clock.slept) == pytest.approx(0.010)
    clock.now += 0.002  # the engine thread's own work between two steps
    runner.forward(step)
    assert clock.now == pytest.approx(100.020)  # paced from the last step's end: the 2 ms are absorbed
    clock.now += 1.0  # idle
    runner.forward(step)
    assert clock.now == pytest.approx(101.030)
    assert runner.modeled_seconds == pytest.approx(0.030)


def test_sim_config_is_one_rank_only():
    with pytest.raises(ValueError, match="--engine must be model or sim"):
        EngineConfig(model_path="m", engine_kind="mock")
    with pytest.raises(ValueError, match="one rank"):
        EngineConfig(model_path="m", engine_kind="sim", tp_size=2)
    with pytest.raises(ValueError, match="--sim-profile is for --engine sim"):
        EngineConfig(model_path="m", sim_profile="p.json")
