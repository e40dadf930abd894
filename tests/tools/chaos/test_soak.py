"""Soak mode without a deployment: its flags, and the fault loop's bounds (tools/chaos/soak.py). The
faults here are scenarios made for the test (they touch nothing); the loop is the real one."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from tools.chaos.config import ChaosConfig, parse_duration
from tools.chaos.main import add_arguments, main
from tools.chaos.scenarios import SCENARIOS, FaultContext, Scenario
from tools.chaos.soak import FaultLog, as_one_scenario, inject_faults, soak_pool

# Every bound of a fault as small as the config allows: a fault's bound is then about a second.
FAST = dict(soak="2s", soak_gap=0.05, ready_timeout=0.3, recovery_timeout=0.3, hung_after=0.3)


@pytest.mark.parametrize("text, seconds", [("90", 90.0), ("90s", 90.0), ("30m", 1800.0), ("1.5h", 5400.0),
                                           (" 2M ", 120.0)])
def test_durations(text, seconds):
    assert parse_duration(text, "--soak") == seconds


@pytest.mark.parametrize("text", ["", "m", "thirty", "-5m", "0", "nan", "inf", "5d"])
def test_bad_durations_are_clear_errors(text):
    with pytest.raises(ValueError, match="--soak"):
        parse_duration(text, "--soak")


def test_bad_soak_flags_exit_2_before_starting_anything(capsys):
    import argparse
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for flags in (["--soak", "half an hour"], ["--soak", "10m", "--soak-gap", "0"]):
        assert main(parser.parse_args(flags)) == 2
    err = capsys.readouterr().err
    assert "--soak: 'half an hour' is not a duration" in err and "--soak-gap must be > 0" in err
    assert ChaosConfig(soak="90s").soak_s == 90.0 and ChaosConfig().soak_s == 0.0


def test_every_fault_has_a_finite_bound_longer_than_its_outage():
    cfg = ChaosConfig()
    for scenario in SCENARIOS:
        assert 0 < cfg.fault_bound_s(scenario.name) < float("inf")
    assert cfg.fault_bound_s("freeze-decode") > cfg.freeze_s
    assert cfg.fault_bound_s("idle") > cfg.idle


def test_the_draw_leaves_out_network_cuts_and_decides_what_failures_may_cost():
    pool = soak_pool(SCENARIOS)
    assert pool and all(s.isolate is None for s in pool)
    assert {"network-cut-prefill", "network-cut-decode", "idle-cut"}.isdisjoint(s.name for s in pool)
    # etcd-restart needs a registry on etcd: drawn only when the soak's deployment has one
    assert "etcd-restart" not in {s.name for s in pool}
    assert "etcd-restart" in {s.name for s in soak_pool(SCENARIOS, "etcd")}
    by_name = {s.name: s for s in SCENARIOS}
    assert not as_one_scenario([by_name["baseline"], by_name["idle"]]).failures_allowed
    assert as_one_scenario([by_name["idle"], by_name["kill-decode"]]).failures_allowed
    assert not as_one_scenario([by_name["kill-decode"]]).unclear_allowed
    assert as_one_scenario([by_name["kill-gateway"]]).unclear_allowed


def _run(pool, cfg: ChaosConfig, seed: int = 3) -> tuple[list[str], FaultLog, float]:
    """The fault loop for cfg.soak; (names drawn, log, the monotonic time it had to stop by)."""
    async def go():
        log = FaultLog()
        until = time.monotonic() + cfg.soak_s
        drawn = await inject_faults(None, None, cfg, ["p"], pool, until, random.Random(seed), log)
        return [s.name for s in drawn], log, until
    return asyncio.run(go())


def _recording(name: str, starts: list[float]) -> Scenario:
    async def inject(ctx: FaultContext) -> None:
        starts.append(time.monotonic())
        ctx.notes.append("done")
    return Scenario(name, "test fault", inject, failures_allowed=False)


def test_faults_are_drawn_by_the_seed_and_none_starts_after_the_duration():
    cfg = ChaosConfig(**FAST)
    starts: list[float] = []
    pool = [_recording("a", starts), _recording("b", starts), _recording("c", starts)]
    names, log, until = _run(pool, cfg)
    assert len(names) >= 2 and set(names) <= {"a", "b", "c"}
    assert all(start < until for start in starts)
    assert sum(log.counts.values()) == len(names) and not log.problems
    assert len(log.notes) == len(names)
    rng = random.Random(3)  # the same draws: gaps and choices interleaved as the loop makes them
    expected = []
    for _ in names:
        rng.uniform(cfg.soak_gap / 2, cfg.soak_gap)
        expected.append(rng.choice(pool).name)
    assert names == expected


def test_a_fault_that_overruns_its_bound_is_cancelled_and_reported():
    cfg = ChaosConfig(**FAST)
    cancelled = []

    async def hang(ctx: FaultContext) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
    names, log, _ = _run([Scenario("stuck", "never returns", hang, failures_allowed=True)], cfg)
    assert names and len(cancelled) == len(names)
    assert all("overran its bound" in problem for problem in log.problems) and len(log.problems) == len(names)


def test_a_fault_that_breaks_the_deployment_ends_the_draw():
    async def broken(ctx: FaultContext) -> None:
        raise RuntimeError("restart failed")
    names, log, _ = _run([Scenario("broken", "raises", broken, failures_allowed=True)], ChaosConfig(**FAST))
    assert names == ["broken"]
    assert log.problems == ["fault 1 (broken) broke the deployment: RuntimeError: restart failed"]
