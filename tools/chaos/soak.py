"""Soak mode (`pdserve bench chaos --soak 30m`): one deployment per backend under the steady load for
the whole duration, with faults drawn at random (seeded by --seed) from --scenarios, one at a time,
each followed by a gap of plain load. When the duration is spent the load stops, KV pages settle,
recovery is checked and the run is judged as one row (runner.judge): hung, wrong, leaked and not
recovered always fail it; failed requests only when no drawn fault may cost any (failures_allowed).

Bounded: no fault starts after the duration is spent, and each is cancelled (and reported) past its
bound (ChaosConfig.fault_bound_s), so the load stops within duration + one fault's bound; settling
and the recovery check add at most --settle + --recovery-timeout. Scenarios that need a network
namespace (their own deployment) are left out of the draw.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tools.chaos.config import ChaosConfig
from tools.chaos.deployment import Deployment
from tools.chaos.load import SteadyLoad
from tools.chaos.observe import MIGRATIONS, gateway_retries, grown
from tools.chaos.recovery import baseline_of, check_recovery, settle_pages
from tools.chaos.reference import NoReferenceAnswer, collect_reference
from tools.chaos.report import Row
from tools.chaos.runner import fill_row, judge, say
from tools.chaos.scenarios import FaultContext, Scenario
from tools.launch import NotReady, ProcessGroup


@dataclass
class FaultLog:
    """What the soak injected: faults by scenario, and the ones that overran their bound or broke."""

    counts: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def soak_pool(scenarios: Sequence[Scenario], registry_store: str = "memory") -> list[Scenario]:
    """The scenarios a soak draws from: those that run on the plain deployment (no network namespace,
    and the registry store the deployment has: etcd-restart only with --registry-store etcd)."""
    return [s for s in scenarios
            if s.isolate is None and s.registry_store in (None, registry_store) and not s.store]


def as_one_scenario(drawn: Sequence[Scenario]) -> Scenario:
    """What the soak row may cost: failures (clear, or unclear too) only if some drawn fault may."""
    async def nothing(ctx: FaultContext) -> None:
        pass
    return Scenario("soak", "random faults", nothing, failures_allowed=any(s.failures_allowed for s in drawn),
                    unclear_allowed=any(s.unclear_allowed for s in drawn))


async def inject_faults(dep: Deployment, load: SteadyLoad, cfg: ChaosConfig, prompts: Sequence[str],
                        pool: Sequence[Scenario], until: float, rng: random.Random,
                        log: FaultLog) -> list[Scenario]:
    """Gaps of plain load and random faults until monotonic time `until`; returns the faults drawn."""
    drawn: list[Scenario] = []
    while True:
        gap = rng.uniform(cfg.soak_gap / 2, cfg.soak_gap)
        if time.monotonic() + gap >= until:
            await asyncio.sleep(max(0.0, until - time.monotonic()))
            return drawn
        await asyncio.sleep(gap)
        if time.monotonic() >= until:  # a loaded machine can wake the loop late: no fault starts past the end
            return drawn
        scenario = rng.choice(pool)
        drawn.append(scenario)
        log.counts[scenario.name] += 1
        ctx = FaultContext(dep, load, cfg, prompts)
        started = time.monotonic()
        say(f"[soak] fault {len(drawn)}: {scenario.name}")
        try:
            await asyncio.wait_for(scenario.inject(ctx), cfg.fault_bound_s(scenario.name))
        except TimeoutError:
            log.problems.append(f"fault {len(drawn)} ({scenario.name}) overran its bound of "
                                f"{cfg.fault_bound_s(scenario.name):.0f}s")
        except Exception as exc:  # a restart that failed: the deployment cannot be trusted any more
            log.problems.append(f"fault {len(drawn)} ({scenario.name}) broke the deployment: "
                                f"{type(exc).__name__}: {str(exc)[:300]}")
            return drawn
        log.problems += [f"fault {len(drawn)} ({scenario.name}): {p}" for p in ctx.problems]
        log.notes += [f"fault {len(drawn)} ({scenario.name}, {time.monotonic() - started:.0f}s): {n}"
                      for n in ctx.notes]


async def soak_on(dep: Deployment, cfg: ChaosConfig, pool: Sequence[Scenario], prompts: Sequence[str]) -> Row:
    started = time.monotonic()
    row = Row("soak", dep.backend)
    try:
        say(f"[{dep.backend} soak] starting bootstrap, 2 prefill, 2 decode, gateway "
            f"(logs in {dep.group.workdir})")
        await dep.start()
        reference = await collect_reference(dep.url, dep.model_name, prompts, cfg.max_tokens)
    except (NotReady, RuntimeError, NoReferenceAnswer) as exc:
        row.problems.append(f"not run: deployment failed: {str(exc)[:300]}")
        return row
    baseline = await baseline_of(dep)
    retries_before = await gateway_retries(dep.gateway) or {}
    migrations_before = await gateway_retries(dep.gateway, MIGRATIONS) or {}
    load = SteadyLoad(dep.url, dep.model_name, prompts, reference.texts, clients=cfg.clients,
                      max_tokens=cfg.max_tokens, hung_after=cfg.hung_after, hung_wait=cfg.hung_wait)
    log = FaultLog()
    gateway_before = dep.gateway
    load.start()
    try:  # the duration counts from here: starting the deployment is not part of it
        drawn = await inject_faults(dep, load, cfg, prompts, pool, time.monotonic() + cfg.soak_s,
                                    random.Random(cfg.seed), log)
        tally = await load.stop()
    except BaseException:
        await load.abort()
        raise
    restarted = any(s.name == "kill-gateway" for s in drawn) or dep.gateway is not gateway_before
    row.gateway_retries = grown(await gateway_retries(dep.gateway) or {}, {} if restarted else retries_before)
    row.gateway_migrations = grown(await gateway_retries(dep.gateway, MIGRATIONS) or {},
                                    {} if restarted else migrations_before)
    settled = await settle_pages(dep, baseline, cfg.settle)
    recovery = await check_recovery(dep, prompts, reference.texts, max_tokens=cfg.max_tokens,
                                    timeout_s=cfg.recovery_timeout)
    fill_row(row, tally, settled, recovery)
    row.faults = dict(log.counts)
    row.notes = log.notes + recovery.notes
    row.problems = list(log.problems)
    judge(row, as_one_scenario(drawn), tally, settled, recovery)
    row.seconds = round(time.monotonic() - started, 1)
    return row


async def soak_backend(backend: str, cfg: ChaosConfig, scenarios: Sequence[Scenario], prompts: Sequence[str],
                       log_root: Path, env: dict[str, str]) -> Row:
    pool = soak_pool(scenarios, cfg.registry_store)
    left_out = [s.name for s in scenarios if s not in pool]
    if left_out:
        say(f"[{backend} soak] left out of the draw (they need a network namespace or another registry "
            f"store): {', '.join(left_out)}")
    if not pool:
        return Row("soak", backend, problems=["no scenario to draw from: --scenarios names only scenarios "
                                              "that need a network namespace or another registry store"])
    with ProcessGroup(log_root / f"{backend}-soak", env=env) as group:
        dep = Deployment(backend, cfg, group)
        try:
            return await soak_on(dep, cfg, pool, prompts)
        finally:
            await dep.stop_all()
