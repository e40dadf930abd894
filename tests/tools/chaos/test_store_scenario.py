"""The kill-store-master scenario: it asks for a deployment whose workers use a Mooncake Store (its
own, with a master), fails on any failed request, stays out of soaks (their deployment has no store)
and out of make test's short chaos run (tests/e2e/test_hicache_master_kill.py covers the fault)."""

from __future__ import annotations

from tests.e2e.test_chaos import SHORT_SCENARIOS as SHORT_RUN_SCENARIOS
from tools.chaos.config import ChaosConfig
from tools.chaos.scenarios import SCENARIOS, select
from tools.chaos.soak import soak_pool


def test_kill_store_master_names_its_deployment_and_stays_out_of_soaks():
    (scenario,) = select("kill-store-master")
    assert scenario.store and not scenario.failures_allowed and not scenario.unclear_allowed
    assert (scenario.isolate, scenario.registry_store) == (None, None)
    assert [s.name for s in SCENARIOS if s.store] == ["kill-store-master"]
    assert "kill-store-master" not in {s.name for s in soak_pool(SCENARIOS)}
    assert "kill-store-master" not in SHORT_RUN_SCENARIOS.split(",")
    cfg = ChaosConfig()
    assert cfg.fault_bound_s("kill-store-master") > cfg.fault_bound_s("baseline") + cfg.recovery_timeout
