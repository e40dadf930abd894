"""Which rows fail, and why: the rules of tools/chaos/runner.py `judge`, the tally and the table."""

from __future__ import annotations

import json

import pytest

from tools.chaos.client import Reply
from tools.chaos.config import ChaosConfig
from tools.chaos.load import Tally
from tools.chaos.recovery import Recovery, Settled
from tools.chaos.report import Row, to_json, to_table
from tools.chaos.runner import judge
from tools.chaos.scenarios import SCENARIOS, select

BY_NAME = {s.name: s for s in SCENARIOS}


def _tally(*replies: Reply, expected: str = "abc") -> Tally:
    tally = Tally()
    for reply in replies:
        tally.sent += 1
        tally.record(reply, expected, "prompt 0 (whole)")
    return tally


def _verdict(scenario: str, tally: Tally, settled: Settled | None = None, recovery: Recovery | None = None,
             retries: dict[str, int] | None = None) -> Row:
    row = Row(scenario, "mooncake", gateway_retries=retries or {})
    judge(row, BY_NAME[scenario], tally, settled or Settled(), recovery or Recovery())
    return row


def test_tally_counts_each_outcome():
    tally = _tally(Reply(text="abc"), Reply(text="abd"), Reply(kind="HTTP 503 x", clear=True),
                   Reply(kind="ConnectError"))
    assert (tally.succeeded, tally.wrong, tally.failed_clear, tally.failed_unclear) == (1, 1, 1, 1)
    assert "differs from character 2" in tally.examples["wrong"]


def test_clear_failures_pass_where_a_worker_goes_away_but_not_where_all_stay_up():
    clear = _tally(Reply(text="abc"), Reply(kind="HTTP 503 worker_unavailable", clear=True))
    assert _verdict("kill-decode", clear).ok
    assert not _verdict("registry-restart", clear).ok


def test_unclear_failures_pass_only_when_the_gateway_itself_dies():
    dropped = _tally(Reply(kind="RemoteProtocolError"))
    assert _verdict("kill-gateway", dropped).ok
    assert "without a clear error" in _verdict("kill-prefill", dropped).problems[0]


@pytest.mark.parametrize("scenario", [s.name for s in SCENARIOS])
def test_hung_wrong_leaked_and_unrecovered_always_fail(scenario):
    hung = Tally(sent=1, hung=1)
    assert not _verdict(scenario, hung).ok
    assert not _verdict(scenario, _tally(Reply(text="zzz"))).ok
    assert not _verdict(scenario, Tally(), settled=Settled(leaked={"prefill-0": 20.0})).ok
    assert not _verdict(scenario, Tally(), recovery=Recovery(recovered=False, not_recovered=["decode-0"])).ok


def test_hidden_retries_fail_only_where_every_worker_stayed_up():
    assert not _verdict("idle", Tally(), retries={"prefill_failed": 1}).ok
    assert _verdict("freeze-prefill", Tally(), retries={"prefill_failed": 1}).ok


def test_hidden_migrations_fail_only_where_every_worker_stayed_up():
    row = Row("idle", "mooncake", gateway_migrations={"worker_lost": 1})
    judge(row, BY_NAME["idle"], Tally(), Settled(), Recovery())
    assert not row.ok and "migrated 1 streams" in row.problems[0]
    row = Row("kill-decode", "mooncake", gateway_migrations={"unavailable": 2})
    judge(row, BY_NAME["kill-decode"], Tally(), Settled(), Recovery())
    assert row.ok and "gateway migrations: {'unavailable': 2}" in to_table([row])
    assert json.loads(to_json([row]))[0]["gateway_migrations"] == {"unavailable": 2}


def test_retries_after_the_fault_fail_every_scenario():
    """A pair that stays broken is hidden by retries on another pair: the recovery check counts them."""
    row = _verdict("kill-gateway", Tally(), recovery=Recovery(retries={"prefill_failed": 2}))
    assert "a (prefill, decode) pair still fails" in row.problems[0]


def test_rows_render_as_json_and_table():
    rows = [Row("kill-decode", "nixl", sent=3, succeeded=3), Row("idle", "nixl", problems=["x"]),
            Row("network-cut-prefill", "nixl", skipped="network namespaces need root")]
    decoded = json.loads(to_json(rows))
    assert [r["ok"] for r in decoded] == [True, False, True]
    table = to_table(rows)
    assert "skipped: network namespaces need root" in table and "FAIL" in table


def test_scenario_selection_and_bounds():
    assert [s.name for s in select("idle,kill-decode")] == ["idle", "kill-decode"]
    assert len(select("all")) == len(SCENARIOS)
    with pytest.raises(ValueError, match="unknown scenario"):
        select("kill-everything")
    config = ChaosConfig(heartbeat_interval=1.0, hung_after=15.0)
    assert config.lease_bound_s == 3.0  # 1 s x (2 missed beats + 1)
    assert config.freeze_s > config.lease_bound_s + config.hung_after  # a freeze outlasts the hung clock
    with pytest.raises(ValueError, match="unknown backend"):
        ChaosConfig(backends="mooncake,carrier-pigeon")
