"""Runs scenarios on deployments of one backend and turns each into a Row.

Per backend: one deployment on 127.0.0.1 for every scenario that needs no network namespace, one
deployment per worker that network scenarios isolate (it runs inside a namespace, so everything binds
the namespace link's addresses; network-cut-decode and idle-cut share decode-1's), and one per
scenario that needs another registry store (etcd-restart: the registry on etcd). On each
deployment: collect the fault-free answers, then for each scenario: steady load for a third of
--duration, the fault (and its repair), two thirds more load, stop the load (every request answered
or hung), let KV pages settle, check recovery, judge.
Processes and namespaces are removed when a deployment is done, whatever happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from tools.bench.serving import mooncake_master
from tools.bench.serving.mooncake_master import MasterProcess
from tools.chaos.config import ChaosConfig
from tools.chaos.deployment import Deployment
from tools.chaos.load import SteadyLoad, Tally
from tools.chaos.netns import NetnsUnavailable, NetworkNamespace
from tools.chaos.observe import MIGRATIONS, gateway_retries, grown
from tools.chaos.recovery import Recovery, Settled, baseline_of, check_recovery, settle_pages
from tools.chaos.reference import NoReferenceAnswer, collect_reference
from tools.chaos.report import Row
from tools.chaos.scenarios import FaultContext, Scenario
from tools.launch import NotReady, ProcessGroup


def say(line: str) -> None:
    """Progress goes to stderr, so that --json leaves stdout to the result."""
    print(line, file=sys.stderr, flush=True)


@dataclass
class BackendResult:
    rows: list[Row] = field(default_factory=list)
    references: list[list[str]] = field(default_factory=list)  # one per deployment


def fill_row(row: Row, tally: Tally, settled: Settled, recovery: Recovery) -> None:
    """What the clients saw, the pages left held and the recovery check, into `row` (a scenario's or a
    soak's)."""
    row.sent, row.succeeded, row.wrong = tally.sent, tally.succeeded, tally.wrong
    row.failed_clear, row.failed_unclear, row.hung = tally.failed_clear, tally.failed_unclear, tally.hung
    row.errors, row.examples, row.hung_details = dict(tally.errors), dict(tally.examples), tally.hung_details
    row.pages_leaked, row.pages_in_use = settled.pages_leaked, settled.in_use
    row.leak_detections = settled.leak_detections
    row.recovered, row.not_recovered = recovery.recovered, recovery.not_recovered
    row.recovery_failed = recovery.tally.sent - recovery.tally.succeeded


def judge(row: Row, scenario: Scenario, tally: Tally, settled: Settled, recovery: Recovery) -> None:
    """Fill `row.problems`: the reasons this row fails (see scenarios.py for what a scenario may cost)."""
    if tally.hung:
        row.problems.append(f"{tally.hung} requests hung (no answer within the hung bound)")
    if tally.wrong + recovery.tally.wrong:
        row.problems.append(f"{tally.wrong + recovery.tally.wrong} answers differ from the fault-free ones")
    if settled.leaked:
        held = ", ".join(f"{name} +{pages:g}" for name, pages in settled.leaked.items())
        row.problems.append(f"KV pages still in use after the settle period: {held}")
    if settled.unreachable:
        row.problems.append(f"no /metrics from {', '.join(settled.unreachable)} after the scenario")
    if settled.leak_detections:
        row.problems.append(f"the workers' leak detector fired {settled.leak_detections:g} times")
    if not recovery.recovered:
        row.problems.append(f"did not recover: {'; '.join(recovery.not_recovered)}")
    if recovery.retries:
        row.problems.append(f"the gateway retried {sum(recovery.retries.values())} attempts after the "
                            f"fault was over ({recovery.retries}): a (prefill, decode) pair still fails")
    if recovery.tally.sent - recovery.tally.succeeded:
        row.problems.append(f"{recovery.tally.sent - recovery.tally.succeeded} of {recovery.tally.sent} "
                            f"requests failed after the fault was over ({dict(recovery.tally.errors)})")
    failed = tally.failed_clear + tally.failed_unclear
    if failed and not scenario.failures_allowed:
        row.problems.append(f"{failed} requests failed although every worker stayed up")
    if row.gateway_migrations and not scenario.failures_allowed:
        row.problems.append(f"the gateway migrated {sum(row.gateway_migrations.values())} streams "
                            f"although every worker stayed up ({row.gateway_migrations})")
    if row.gateway_retries and not scenario.failures_allowed:
        row.problems.append(f"the gateway retried {sum(row.gateway_retries.values())} attempts "
                            f"although every worker stayed up ({row.gateway_retries})")
    elif tally.failed_unclear and not scenario.unclear_allowed:
        row.problems.append(f"{tally.failed_unclear} requests failed without a clear error")


async def run_scenario(dep: Deployment, scenario: Scenario, cfg: ChaosConfig, prompts: Sequence[str],
                       reference: Sequence[str]) -> Row:
    started = time.monotonic()
    row = Row(scenario.name, dep.backend)
    baseline = await baseline_of(dep)
    gateway_before, retries_before = dep.gateway, await gateway_retries(dep.gateway) or {}
    migrations_before = await gateway_retries(dep.gateway, MIGRATIONS) or {}
    load = SteadyLoad(dep.url, dep.model_name, prompts, reference, clients=cfg.clients,
                      max_tokens=cfg.max_tokens, hung_after=cfg.hung_after, hung_wait=cfg.hung_wait)
    ctx = FaultContext(dep, load, cfg, prompts)
    load.start()
    try:
        await asyncio.sleep(cfg.duration / 3)
        await scenario.inject(ctx)
        await asyncio.sleep(cfg.duration * 2 / 3)
        tally = await load.stop()
    except BaseException:
        await load.abort()
        raise
    restarted = dep.gateway is not gateway_before  # a restarted gateway counts from 0
    row.gateway_retries = grown(await gateway_retries(dep.gateway) or {}, {} if restarted else retries_before)
    row.gateway_migrations = grown(await gateway_retries(dep.gateway, MIGRATIONS) or {},
                                    {} if restarted else migrations_before)
    settled = await settle_pages(dep, baseline, cfg.settle)
    recovery = await check_recovery(dep, prompts, reference, max_tokens=cfg.max_tokens,
                                    timeout_s=cfg.recovery_timeout)
    fill_row(row, tally, settled, recovery)
    row.disconnects = dict(ctx.disconnects) if ctx.disconnects is not None else None
    row.notes = ctx.notes + recovery.notes
    row.problems = list(ctx.problems)
    judge(row, scenario, tally, settled, recovery)
    row.seconds = round(time.monotonic() - started, 1)
    return row


async def _run_on(dep: Deployment, scenarios: Sequence[Scenario], cfg: ChaosConfig,
                  prompts: Sequence[str], result: BackendResult) -> None:
    label = f"[{dep.backend}{' ' + dep.isolated + ' isolated' if dep.isolated else ''}]"
    try:
        say(f"{label} starting bootstrap, 2 prefill, 2 decode, gateway (logs in {dep.group.workdir})")
        await dep.start()
        reference = await collect_reference(dep.url, dep.model_name, prompts, cfg.max_tokens)
    except (NotReady, RuntimeError, NoReferenceAnswer) as exc:
        say(f"{label} deployment failed: {exc}")
        result.rows += [Row(s.name, dep.backend, problems=[f"not run: deployment failed: {str(exc)[:300]}"])
                        for s in scenarios]
        return
    result.references.append(reference.texts)
    # Readiness must mean "can serve": refusals after /health said 200 (with all four workers seen) are
    # charged to the first row of the deployment.
    startup_problem = (f"at start-up the gateway refused {reference.refused_after_healthy} requests after "
                       "/health said 200") if reference.refused_after_healthy else None
    broken: str | None = None
    for scenario in scenarios:
        if broken:
            result.rows.append(Row(scenario.name, dep.backend, problems=[f"not run: {broken}"]))
            continue
        say(f"{label} {scenario.name}: {scenario.about}")
        try:
            row = await run_scenario(dep, scenario, cfg, prompts, reference.texts)
        except Exception as exc:
            # A restart that failed, a harness bug: report it, keep the other backends going.
            broken = f"the deployment broke in {scenario.name}"
            row = Row(scenario.name, dep.backend,
                      problems=[f"scenario could not run: {type(exc).__name__}: {str(exc)[:300]}"])
        if startup_problem:
            row.problems.insert(0, startup_problem)
            startup_problem = None
        verdict = "pass" if row.ok else "FAIL: " + "; ".join(row.problems)
        say(f"{label} {scenario.name}: sent {row.sent}, ok {row.succeeded}, clear {row.failed_clear}, "
            f"unclear {row.failed_unclear}, hung {row.hung}, wrong {row.wrong}, leaked {row.pages_leaked}, "
            f"recovered {row.recovered} -> {verdict}")
        result.rows.append(row)


async def _deployment_run(backend: str, cfg: ChaosConfig, scenarios: Sequence[Scenario],
                          prompts: Sequence[str], log_dir: Path, env: dict[str, str],
                          result: BackendResult, *, netns: NetworkNamespace | None = None,
                          isolated: str | None = None, store: bool = False) -> None:
    with contextlib.ExitStack() as stack, ProcessGroup(log_dir, env=env) as group:
        # the group's exit kills whatever still runs, whatever happened; then the stack's: the master
        master = stack.enter_context(MasterProcess(log_dir / "mooncake_master")) if store else None
        dep = Deployment(backend, cfg, group, host=netns.host_address if netns else "127.0.0.1",
                         netns=netns, isolated=isolated, store=master)
        await _run_on(dep, scenarios, cfg, prompts, result)
        await dep.stop_all()  # the orderly way: gateway, workers, registry


async def run_backend(backend: str, cfg: ChaosConfig, scenarios: Sequence[Scenario], prompts: Sequence[str],
                      log_root: Path, env: dict[str, str]) -> BackendResult:
    result = BackendResult()
    plain = [s for s in scenarios if s.isolate is None and s.registry_store in (None, cfg.registry_store)
             and not s.store]
    if plain:
        await _deployment_run(backend, cfg, plain, prompts, log_root / backend, env, result)
    for scenario in (s for s in scenarios if s.registry_store not in (None, cfg.registry_store)):
        # a registry store of its own (etcd-restart: the registry on etcd), in a deployment of its own
        if scenario.registry_store == "etcd" and shutil.which("etcd") is None:
            why = "etcd is not installed (scripts/setup.sh installs etcd-server)"
            say(f"[{backend}] {scenario.name} skipped: {why}")
            result.rows.append(Row(scenario.name, backend, skipped=why))
            continue
        await _deployment_run(backend, replace(cfg, registry_store=scenario.registry_store), [scenario],
                              prompts, log_root / f"{backend}-{scenario.name}", env, result)
    stored = [s for s in scenarios if s.store]
    if stored and mooncake_master.binary() is None:
        for scenario in stored:
            why = "mooncake_master is not installed (it comes with the Mooncake wheel)"
            say(f"[{backend}] {scenario.name} skipped: {why}")
            result.rows.append(Row(scenario.name, backend, skipped=why))
    elif stored:  # workers on a Mooncake Store of their own, in a deployment of their own
        await _deployment_run(backend, cfg, stored, prompts, log_root / f"{backend}-store", env, result,
                              store=True)
    # one namespace deployment per isolated worker, shared by the scenarios that isolate it
    isolated: dict[str, list[Scenario]] = {}
    for scenario in (s for s in scenarios if s.isolate is not None):
        isolated.setdefault(scenario.isolate, []).append(scenario)
    for group in isolated.values():
        try:
            netns = NetworkNamespace.create()
        except NetnsUnavailable as exc:
            for scenario in group:
                say(f"[{backend}] {scenario.name} skipped: {exc}")
                result.rows.append(Row(scenario.name, backend, skipped=str(exc)))
            continue
        with netns:
            await _deployment_run(backend, cfg, group, prompts, log_root / f"{backend}-{group[0].name}",
                                  env, result, netns=netns, isolated=group[0].isolate)
    return result
