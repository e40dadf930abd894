"""The faults, one scenario each, injected while the steady load runs.

A scenario's `inject` does the fault and, where there is one, the repair (restart, SIGCONT, link up),
and tells the load when the fault became detectable (`load.fault_at`), which starts the hung clock of
requests already waiting. What a scenario may cost the clients:
- `failures_allowed`: a serving worker (or the registry's view of it) goes away, so requests on it may
  fail, but only clearly; when False (every worker stays up), any failed request is a problem.
- `unclear_allowed`: the gateway itself dies, so its open connections drop without an error body.
Hung and wrong answers, leaked pages and workers that do not serve afterwards are always problems.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import httpx

from tools.chaos.abort_window import MODES as ABORT_WINDOW_MODES
from tools.chaos.abort_window import abort_around_first_token
from tools.chaos.client import TIMEOUT, chat
from tools.chaos.config import ChaosConfig
from tools.chaos.deployment import Deployment
from tools.chaos.disconnects import MODES, disconnect_clients
from tools.chaos.lifecycle import stop
from tools.chaos.load import SteadyLoad
from tools.chaos.observe import scrape_service
from tools.metrics import sum_samples

DISCONNECT_MAX_TOKENS = 256  # long answers, so that streams and decodes have a middle to be cut in
_HEALTH_PROBE_REQUESTS = 8


@dataclass
class FaultContext:
    """What an `inject` works with, and where it leaves what it saw."""

    dep: Deployment
    load: SteadyLoad
    config: ChaosConfig
    prompts: Sequence[str]
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    disconnects: Counter | None = None

    def fault_now(self) -> None:
        """The fault just happened: the system can know within one lease bound."""
        self.load.fault_at(time.monotonic() + self.config.lease_bound_s)


@dataclass(frozen=True)
class Scenario:
    """One fault: `name` (the --scenarios value), what it does, how to inject it, what it may cost."""

    name: str
    about: str
    inject: Callable[[FaultContext], Awaitable[None]]
    failures_allowed: bool
    unclear_allowed: bool = False
    isolate: str | None = None  # worker that runs inside a network namespace for this scenario
    registry_store: str | None = None  # the registry store this scenario needs (its own deployment)
    store: bool = False  # the workers use a Mooncake Store KV tier (its own deployment, with a master)


# -- no fault ---------------------------------------------------------------------------------------------

async def _no_fault(ctx: FaultContext) -> None:
    """The control: the same load and checks with nothing broken. A wrong answer here means greedy
    output depends on batching (exact-match judging is then unsound), not that a fault corrupted it."""


# -- kill -9 and restart ----------------------------------------------------------------------------

def _kill_worker(name: str) -> Callable[[FaultContext], Awaitable[None]]:
    async def inject(ctx: FaultContext) -> None:
        await stop(ctx.dep.workers[name], signal.SIGKILL)
        ctx.fault_now()
        restarted = await ctx.dep.restart_worker(name)
        ctx.notes.append(f"{name} restarted as pid {restarted.pid} on {restarted.address}")
    return inject


async def _kill_bootstrap(ctx: FaultContext) -> None:
    assert ctx.dep.bootstrap is not None
    await stop(ctx.dep.bootstrap, signal.SIGKILL)
    ctx.fault_now()
    await ctx.dep.restart_bootstrap()


async def _kill_gateway(ctx: FaultContext) -> None:
    assert ctx.dep.gateway is not None
    await stop(ctx.dep.gateway, signal.SIGKILL)
    ctx.fault_now()
    await ctx.dep.restart_gateway()
    await _probe_health_claim(ctx)


async def _probe_health_claim(ctx: FaultContext) -> None:
    """Readiness must mean "can serve": the moment /health first says 200, requests must succeed."""
    deadline = time.monotonic() + ctx.config.recovery_timeout
    while (await ctx.dep.health())[0] != 200:
        if time.monotonic() > deadline:
            ctx.notes.append(f"restarted gateway not healthy within {ctx.config.recovery_timeout:.0f}s")
            return
        await asyncio.sleep(0.05)
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        replies = await asyncio.gather(*(
            asyncio.wait_for(chat(http, ctx.dep.url, ctx.dep.model_name, ctx.prompts[i % len(ctx.prompts)],
                                  ctx.config.max_tokens, stream=False), ctx.config.hung_after)
            for i in range(_HEALTH_PROBE_REQUESTS)), return_exceptions=True)
    failed = Counter(type(r).__name__ if isinstance(r, BaseException) else r.kind
                     for r in replies if isinstance(r, BaseException) or not r.ok)
    if failed:
        ctx.problems.append(f"the restarted gateway said healthy, yet {sum(failed.values())}/"
                            f"{_HEALTH_PROBE_REQUESTS} requests sent right then failed ({dict(failed)})")


# -- freezes ------------------------------------------------------------------------------------------

def _freeze_worker(name: str) -> Callable[[FaultContext], Awaitable[None]]:
    async def inject(ctx: FaultContext) -> None:
        victim = ctx.dep.workers[name]
        victim.send(signal.SIGSTOP)
        ctx.fault_now()
        try:
            await asyncio.sleep(ctx.config.freeze_s)
        finally:
            victim.send(signal.SIGCONT)
        ctx.notes.append(f"{name} stopped for {ctx.config.freeze_s:.0f}s")
    return inject


# -- clients leaving ----------------------------------------------------------------------------------

async def _disconnects(ctx: FaultContext) -> None:
    ctx.disconnects = await disconnect_clients(ctx.dep.url, ctx.dep.model_name, ctx.prompts,
                                               count=ctx.config.disconnects, max_tokens=DISCONNECT_MAX_TOKENS,
                                               seed=ctx.config.seed)
    cut = sum(ctx.disconnects.get(mode, 0) for mode in MODES)
    ctx.notes.append(f"{cut} of {ctx.config.disconnects} requests cut by their client "
                     f"({dict(ctx.disconnects)})")


async def _abort_window(ctx: FaultContext) -> None:
    counts = await abort_around_first_token(ctx.dep.url, ctx.dep.model_name, ctx.prompts,
                                            count=ctx.config.disconnects, max_tokens=DISCONNECT_MAX_TOKENS,
                                            seed=ctx.config.seed)
    ctx.disconnects = counts
    cut = sum(counts.get(mode, 0) for mode in ABORT_WINDOW_MODES)
    ctx.notes.append(f"{cut} of {ctx.config.disconnects} requests cut around their first token "
                     f"({dict(counts)})")


# -- registry downtime -------------------------------------------------------------------------------

async def _registry_restart(ctx: FaultContext) -> None:
    assert ctx.dep.bootstrap is not None
    await stop(ctx.dep.bootstrap, signal.SIGTERM)
    ctx.fault_now()
    await asyncio.sleep(ctx.config.registry_down)
    await ctx.dep.restart_bootstrap()
    ctx.notes.append(f"registry down for {ctx.config.registry_down:.0f}s")


# -- network cut ----------------------------------------------------------------------------------------

async def _busy(ctx: FaultContext, name: str, timeout_s: float = 3.0) -> bool:
    """Wait until worker `name` has requests past its first queue (prefill or transfer in progress)."""
    worker = ctx.dep.workers[name]
    queues = ("waiting", "inflight") if name.startswith("prefill") else ("transfer", "waiting", "running")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        samples = await scrape_service(worker) or {}
        if any((sum_samples(samples, "pdserve:queue_requests", queue=q) or 0) > 0 for q in queues):
            return True
        await asyncio.sleep(0.02)
    return False


def _cut_network(name: str) -> Callable[[FaultContext], Awaitable[None]]:
    async def inject(ctx: FaultContext) -> None:
        netns = ctx.dep.netns
        assert netns is not None and ctx.dep.isolated == name
        busy = await _busy(ctx, name)
        netns.cut()
        ctx.fault_now()
        try:
            await asyncio.sleep(ctx.config.network_cut_s)
        finally:
            netns.restore()
        ctx.notes.append(f"{name}'s link cut for {ctx.config.network_cut_s:.0f}s "
                         f"({'with' if busy else 'no'} requests seen in its queues at the cut)")
    return inject


# -- a new process at an old address -------------------------------------------------------------------

async def _restart_prefill_in_place(ctx: FaultContext) -> None:
    """kill -9 prefill-0 while it has prompts or KV writes in flight, then start a new process on the
    same host and gRPC port: decode must not take it for the old one (stale channel, the old process's
    rooms) and must free the pages the old one was writing."""
    name = "prefill-0"
    busy = await _busy(ctx, name)
    old = ctx.dep.workers[name]
    await stop(old, signal.SIGKILL)
    ctx.fault_now()
    restarted = await ctx.dep.restart_worker(name, same_address=True)
    ctx.notes.append(f"{name} (pid {old.pid}) killed {'with' if busy else 'without'} requests in its queues, "
                     f"restarted as pid {restarted.pid} on the same address {restarted.address}")
    if restarted.address != old.address:
        ctx.problems.append(f"{name} came back on {restarted.address}, not on its old address {old.address}")


# -- idle ----------------------------------------------------------------------------------------------

async def _idle(ctx: FaultContext) -> None:
    await ctx.load.pause(ctx.config.idle)
    ctx.notes.append(f"no traffic for {ctx.config.idle:.0f}s, then load again")


# -- the registry's etcd ------------------------------------------------------------------------------

async def _registry_sees_all(ctx: FaultContext, timeout_s: float) -> float | None:
    """Seconds until the registry's view is current again (its store up) with all four workers in
    it (pdserve:bootstrap_store_up, pdserve:bootstrap_workers); None if not within `timeout_s`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        samples = await scrape_service(ctx.dep.bootstrap) if ctx.dep.bootstrap is not None else None
        if samples and sum_samples(samples, "pdserve:bootstrap_store_up") == 1 \
                and (sum_samples(samples, "pdserve:bootstrap_workers") or 0) >= len(ctx.dep.workers):
            return time.monotonic() - started
        await asyncio.sleep(0.1)
    return None


async def _etcd_restart(ctx: FaultContext) -> None:
    """kill -9 the registry's etcd, keep it down, start it on its data; then again on a wiped data
    dir (every record and lease gone). The workers must be back in the registry by themselves."""
    etcd = ctx.dep.etcd
    assert etcd is not None, "etcd-restart runs on a deployment with --registry-store etcd"
    for wipe in (False, True):
        await etcd.kill()
        ctx.fault_now()
        await asyncio.sleep(ctx.config.etcd_down)
        await ctx.dep.start_etcd(wipe=wipe)
        healed_s = await _registry_sees_all(ctx, ctx.config.recovery_timeout)
        how = "wiped" if wipe else "on its data"
        if healed_s is None:
            ctx.problems.append(f"etcd restarted {how}: the registry did not list all "
                                f"{len(ctx.dep.workers)} workers within {ctx.config.recovery_timeout:.0f}s")
            return
        ctx.notes.append(f"etcd down {ctx.config.etcd_down:.0f}s, restarted {how}: every worker back in the "
                         f"registry {healed_s:.1f}s later")


# -- the KV store's master -----------------------------------------------------------------------------

STORE_DOWN_S = 3.0  # the master dead, then frozen, this long each: requests keep coming meanwhile


async def _store_metric(ctx: FaultContext, name: str) -> list[float | None]:
    """`name` on every worker (None: the scrape failed)."""
    samples = await asyncio.gather(*(scrape_service(w) for w in ctx.dep.workers.values()))
    return [sum_samples(s, name) if s else None for s in samples]


async def _store_up_again(ctx: FaultContext, after: str) -> None:
    deadline = time.monotonic() + ctx.config.recovery_timeout
    while (ups := await _store_metric(ctx, "pdserve:hicache_store_up")) != [1.0] * len(ctx.dep.workers):
        if time.monotonic() > deadline:
            ctx.problems.append(f"{after}: not every worker reports the store up within "
                                f"{ctx.config.recovery_timeout:.0f}s (hicache_store_up {ups})")
            return
        await asyncio.sleep(0.2)


async def _kill_store_master(ctx: FaultContext) -> None:
    """kill -9 the Mooncake Store master, keep it dead a few seconds, start it on its port (empty);
    then SIGSTOP it a few seconds and SIGCONT. Requests are computed without the store meanwhile: none
    may fail, answers stay exact, every worker reports the store up again after each."""
    master = ctx.dep.store
    assert master is not None, "kill-store-master runs on a deployment with a Mooncake Store"
    hits = sum(h or 0 for h in await _store_metric(ctx, "pdserve:hicache_hit_pages_total"))
    errors = sum(e or 0 for e in await _store_metric(ctx, "pdserve:hicache_store_errors_total"))
    master.kill()
    await asyncio.sleep(STORE_DOWN_S)
    await asyncio.to_thread(master.start)
    await _store_up_again(ctx, "master restarted")
    master.signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(STORE_DOWN_S)
    finally:
        master.signal(signal.SIGCONT)
    await _store_up_again(ctx, "master thawed")
    errors = sum(e or 0 for e in await _store_metric(ctx, "pdserve:hicache_store_errors_total")) - errors
    # A worker whose requests all hit its local cache meanwhile made no store call, so saw nothing.
    ctx.notes.append(f"mooncake_master killed {STORE_DOWN_S:.0f}s, restarted on its port, frozen "
                     f"{STORE_DOWN_S:.0f}s; {hits:.0f} store page hits before, {errors:.0f} failed store "
                     "calls")


# -- idle, with the connections silently dropped ------------------------------------------------------

async def _idle_cut(ctx: FaultContext) -> None:
    """No traffic for --idle seconds; meanwhile the open TCP connections to the isolated worker's gRPC
    port are dropped silently (a firewall or NAT that forgot idle flows: no RST), then the rule is
    removed and load comes back. Requests after the idle period must be served, none hung."""
    netns, name = ctx.dep.netns, ctx.dep.isolated
    assert netns is not None and name is not None
    port = ctx.dep.workers[name].port
    pausing = asyncio.create_task(ctx.load.pause(ctx.config.idle))
    # the requests in flight finish first (a few seconds; pause() then counts the idle time)
    settle_s = min(10.0, ctx.config.idle / 4)
    await asyncio.sleep(settle_s)
    try:
        cut = netns.cut_idle_flows(port)
        ctx.fault_now()
        await asyncio.sleep(max(ctx.config.idle - settle_s - 2, 1.0))
    finally:
        netns.restore_idle_flows()
        await pausing
    ctx.notes.append(f"no traffic for {ctx.config.idle:.0f}s; {cut} open connection(s) to {name} dropped "
                     f"silently for {ctx.config.idle - settle_s - 2:.0f}s of it, then load again")


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("baseline", "no fault: the same load and checks, as a control", _no_fault,
             failures_allowed=False),
    Scenario("kill-bootstrap", "kill -9 the registry, start it again on its port", _kill_bootstrap,
             failures_allowed=False),
    Scenario("kill-prefill", "kill -9 prefill-0, start it again", _kill_worker("prefill-0"),
             failures_allowed=True),
    Scenario("kill-decode", "kill -9 decode-0, start it again", _kill_worker("decode-0"),
             failures_allowed=True),
    Scenario("kill-gateway", "kill -9 the gateway, start it again on its port; requests right after its "
             "/health says 200 must succeed", _kill_gateway, failures_allowed=True, unclear_allowed=True),
    Scenario("freeze-prefill", "SIGSTOP prefill-0 past the lease bound, then SIGCONT",
             _freeze_worker("prefill-0"), failures_allowed=True),
    Scenario("freeze-decode", "SIGSTOP decode-0 past the lease bound, then SIGCONT",
             _freeze_worker("decode-0"), failures_allowed=True),
    Scenario("disconnects", "clients drop requests before the first token, mid-stream and mid-answer",
             _disconnects, failures_allowed=False),
    Scenario("registry-restart", "stop the registry, keep it down, start a new one on its port",
             _registry_restart, failures_allowed=False),
    Scenario("network-cut-prefill", "cut prefill-1's link (network namespace) mid-transfer, restore it",
             _cut_network("prefill-1"), failures_allowed=True, isolate="prefill-1"),
    Scenario("network-cut-decode", "cut decode-1's link (network namespace) mid-transfer, restore it",
             _cut_network("decode-1"), failures_allowed=True, isolate="decode-1"),
    Scenario("prefill-restart", "kill -9 prefill-0 mid-transfer, start a new process on its old gRPC port",
             _restart_prefill_in_place, failures_allowed=True),
    Scenario("abort-window", "clients leave around the first token: aborts land as prefill finishes and "
             "decode admits", _abort_window, failures_allowed=False),
    Scenario("idle", "no traffic for a while (idle gRPC channels), then load again", _idle,
             failures_allowed=False),
    Scenario("etcd-restart", "registry on etcd: kill -9 etcd, start it on its data, then again wiped; "
             "workers re-register by themselves", _etcd_restart, failures_allowed=False,
             registry_store="etcd"),
    Scenario("idle-cut", "no traffic; the open connections to decode-1 dropped silently (iptables in its "
             "namespace), then load again", _idle_cut, failures_allowed=False, isolate="decode-1"),
    Scenario("kill-store-master", "workers on Mooncake Store (--enable-hierarchical-cache): kill -9 its "
             "master, start it on its port, then SIGSTOP it a while; no request may fail", _kill_store_master,
             failures_allowed=False, store=True),
)


def select(names: str) -> list[Scenario]:
    """Scenarios named in a comma-separated list (in that order), or all of them for 'all'."""
    if names.strip() == "all":
        return list(SCENARIOS)
    by_name = {s.name: s for s in SCENARIOS}
    chosen = []
    for name in (n.strip() for n in names.split(",")):
        if name not in by_name:
            raise ValueError(f"--scenarios: unknown scenario {name!r}; "
                             f"choose from {', '.join(by_name)} or all")
        chosen.append(by_name[name])
    return chosen
