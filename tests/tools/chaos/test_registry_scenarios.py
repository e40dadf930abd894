"""The etcd-restart and idle-cut scenarios: where they sit and what deployment they ask for."""

from __future__ import annotations

import pytest

from tools.chaos.config import ChaosConfig
from tools.chaos.scenarios import SCENARIOS, select


def test_they_come_after_idle_and_name_their_deployment():
    names = [s.name for s in SCENARIOS]
    assert names.index("idle") < names.index("etcd-restart") < names.index("idle-cut")
    etcd_restart, idle_cut = select("etcd-restart,idle-cut")
    assert (etcd_restart.registry_store, etcd_restart.isolate) == ("etcd", None)
    assert (idle_cut.registry_store, idle_cut.isolate) == (None, "decode-1")
    assert not etcd_restart.failures_allowed and not idle_cut.failures_allowed


def test_registry_store_flag_is_checked():
    assert ChaosConfig(registry_store="etcd").registry_store == "etcd"
    with pytest.raises(ValueError, match="--registry-store: unknown store 'zookeeper'"):
        ChaosConfig(registry_store="zookeeper")
