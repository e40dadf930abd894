"""The chaos suite through its command, `pdserve bench chaos --json`, as an operator runs it. Each row
must show no hung request, no wrong answer, no leaked KV page, every worker serving afterwards, and no
other problem the suite reports (tools/chaos/runner.py: judge). On failure the rows' problems and
every process's log tail are printed; the logs stay in pytest's tmp_path.

`make test` runs the short run: the scenarios that no other e2e test covers, each on one of the two
real backends (baseline, the control, on both): a network cut of the prefill on nixl (whose
connections stay marked broken after a cut), of the decode on mooncake; clients leaving on nixl, the
gateway killed on mooncake. The other scenarios each have a test of their own, which `make test` runs:

| scenario | covered by |
|---|---|
| kill-bootstrap, registry-restart | tests/e2e/test_gateway_faults.py (registry restart), test_etcd_heal.py |
| kill-prefill | tests/e2e/test_pd_faults.py, test_gateway.py (a prefill killed under load) |
| kill-decode | tests/e2e/test_migration.py, test_pd_faults.py |
| freeze-prefill | tests/e2e/test_pd_faults.py (a prefill that stops heartbeating) |
| freeze-decode | tests/e2e/test_gateway_faults.py (a frozen decode's open streams) |
| prefill-restart | tests/e2e/test_prefill_restart.py |
| abort-window | tests/e2e/test_abort_window.py (the abort placed in the window by a hook) |
| idle | tests/services/common/test_keepalive.py (the ping policy), tests/e2e/test_idle_cut.py |
| etcd-restart | tests/e2e/test_etcd_heal.py |
| idle-cut | tests/e2e/test_idle_cut.py |
| kill-store-master | tests/e2e/test_hicache_master_kill.py |

`make test-all` (pytest --long) also runs the whole table, every scenario on both backends with the
command's default bounds, and a short soak.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.alone]

# backend -> its scenarios in the short run
SHORT_RUNS = {"nixl": "baseline,disconnects,network-cut-prefill",
              "mooncake": "baseline,kill-gateway,network-cut-decode"}
SHORT_SCENARIOS = ",".join(dict.fromkeys(",".join(SHORT_RUNS.values()).split(",")))
SHORT_ARGS = ["--duration", "4", "--clients", "4", "--disconnects", "100", "--hung-after", "10",
              "--hung-wait", "10"]
SOAK = ["--backends", "mooncake", "--soak", "30s", "--soak-gap", "4", "--seed", "3",
        "--scenarios", "abort-window,disconnects,baseline", "--disconnects", "12", "--clients", "4",
        "--hung-after", "10", "--hung-wait", "10"]
# Every process pings its gRPC peers every 4 s instead of 10 in the whole table's idle scenario: gRPC's
# server-side ping policy, which that scenario is there to catch, would cut an idle channel after three
# pings (12 s), so 15 s of idle shows the same thing as the default's 45 s, in a third of the time.
KEEPALIVE_ENV = {"PDSERVE_GRPC_KEEPALIVE_TIME": "4"}


def log_tails(log_dir: Path) -> str:
    return "\n".join(f"===== {path.relative_to(log_dir)} =====\n{path.read_text(errors='replace')[-3000:]}"
                     for path in sorted(log_dir.rglob("*.log")))


def run_chaos(tmp_path: Path, model: Path, args: list[str], timeout_s: float,
              env: dict[str, str] | None = None) -> list[dict]:
    """`pdserve bench chaos --json ARGS`: its rows (the logs under tmp_path/logs, printed on failure)."""
    log_dir = tmp_path / "logs"
    run = subprocess.run([sys.executable, "-m", "pdserve", "bench", "chaos", "--json",
                          "--log-dir", str(log_dir), "--model-path", str(model), *args],
                         capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **(env or {})})
    try:
        rows = json.loads(run.stdout)
    except ValueError:
        pytest.fail(f"no JSON from the suite (exit {run.returncode}):\n"
                    f"{run.stdout[-3000:]}\n{run.stderr[-6000:]}")
    if any(not row["ok"] for row in rows) or run.returncode != 0:
        print(run.stderr[-8000:])
        print(log_tails(log_dir))
    return rows


def assert_rows_clean(rows: list[dict]) -> None:
    for row in rows:
        if row["skipped"]:
            continue
        label = f"{row['scenario']}/{row['backend']}"
        assert row["hung"] == 0, f"{label}: {row['hung_details']}"
        assert row["wrong"] == 0, f"{label}: {row['examples'].get('wrong')}"
        assert row["pages_leaked"] == 0, f"{label}: {row['pages_in_use']}"
        assert row["recovered"], f"{label}: {row['not_recovered']}"
    failing = [row for row in rows if not row["ok"]]
    assert not failing, "\n".join(f"{row['scenario']}/{row['backend']}: {row['problems']}" for row in failing)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("backend", SHORT_RUNS)
def test_chaos_suite_short_run(tmp_path, tiny_model, backend):
    scenarios = SHORT_RUNS[backend]
    rows = run_chaos(tmp_path, tiny_model, ["--backends", backend, "--scenarios", scenarios, *SHORT_ARGS],
                     timeout_s=600)
    assert {(row["scenario"], row["backend"]) for row in rows} == {(s, backend) for s in scenarios.split(",")}
    assert_rows_clean(rows)


@pytest.mark.long
@pytest.mark.timeout(3600)
def test_chaos_suite_whole_table(tmp_path, tiny_model):
    rows = run_chaos(tmp_path, tiny_model, ["--idle", "15"], timeout_s=3500, env=KEEPALIVE_ENV)
    assert {row["backend"] for row in rows} == {"mooncake", "nixl"}
    assert_rows_clean(rows)


@pytest.mark.long
@pytest.mark.timeout(400)
def test_short_soak(tmp_path, tiny_model):
    """Soak mode: faults drawn from the quick scenarios (clients leaving, around the first token too,
    and the control) on one backend; the one row must show faults injected, load served and nothing
    wrong, and the command must end by itself (the subprocess timeout is far above its bound)."""
    (row,) = run_chaos(tmp_path, tiny_model, SOAK, timeout_s=360)
    assert row["scenario"] == "soak" and row["backend"] == "mooncake"
    assert (sum(row["faults"].values()) >= 2
            and set(row["faults"]) <= {"abort-window", "disconnects", "baseline"})
    assert row["sent"] > 0 and row["succeeded"] == row["sent"]  # none of these faults may fail a request
    assert_rows_clean([row])
