"""DPEngine: DP attention's D groups behind the one Engine API a worker uses.

Each DP group is a member Engine of its own: its own requests, scheduler, page manager (so its
own KV pool's pages and prefix cache) and engine thread. The groups' forward passes must run
together, since every layer's MLP spans all of them (engine.tp.dp_attention), so a member's
runner hands its plan to the `DPStepper`, which joins whatever plans the members have ready into
one DPStep, runs it over every rank (rank 0 broadcasts it like any step) and gives each member
its own logits. A member with nothing to do is simply absent from the step: its ranks run only
the MLP collectives.

Placement: a new request goes to the group whose prefix cache holds the longest run of its
prompt's leading pages, ties (and no hit anywhere) to the least loaded (live requests placed
there, then used pages), and ties of those in turn (round robin). The worker's KV events cover
every group's cache (a page hash is "stored" while any group holds it), so the gateway's
cache-aware routing picks the worker and the worker the group.

PD: a decode worker reserves a room's pages on a group (`reserve_prompt`, placed the same way) and
the prefilled request then runs there; `group_of(room)` and `pool_for(room)` tell the KV transfer
(libkv.transfer.dp_groups) which group's ranks hold the room's pages, on prefill and decode alike.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager
from dataclasses import fields, replace

import torch

from engine.api import EngineAPI
from engine.config import EngineConfig
from engine.engine import Engine, pages_freed_event
from engine.loading import _page_manager, load
from engine.models.moe import ExpertLoad
from engine.outputs import EngineStats, TokenOutput
from engine.request import EngineRequest
from engine.scheduler import SchedulerOutput
from engine.tp.dp_attention import DPStep
from engine.tp.ranks import FollowerRanks
from libkv.landing import RankGroupPool
from pdserve.page_hash import page_hashes

# How long the member that starts a step waits for the other members with work to hand in their
# plans: without it, groups that stepped together once drift into alternate steps (each step then
# carries one group's batch while the others wait), halving throughput.
JOIN_WINDOW_S = 0.002


class DPStepper:
    """Joins the members' plans into DPSteps and runs them (see the module doc). Thread-safe: each
    member's engine thread calls `forward`; one of them runs the step, the others wait for it."""

    def __init__(self, driver, dp_size: int) -> None:
        self.driver = driver  # engine.tp.runner.DriverRunner over the DPRankRunner of rank 0
        self.dp_size = dp_size
        self.has_work: list[Callable[[], bool]] = [lambda: False] * dp_size
        self._cond = threading.Condition()
        self._pending: dict[int, SchedulerOutput] = {}
        self._results: dict[int, torch.Tensor | BaseException] = {}
        self._running = False

    def forward(self, member: int, batch: SchedulerOutput) -> torch.Tensor:
        with self._cond:
            self._pending[member] = batch
            self._cond.notify_all()
            while member not in self._results:
                if self._running:
                    self._cond.wait()
                    continue
                self._running = True  # this member leads the next step
                deadline = time.monotonic() + JOIN_WINDOW_S
                while not self._all_ready() and (left := deadline - time.monotonic()) > 0:
                    self._cond.wait(left)
                taken, self._pending = self._pending, {}
                self._cond.release()
                try:
                    results = self._run(taken)
                finally:
                    self._cond.acquire()
                self._results.update(results)
                self._running = False
                self._cond.notify_all()
            result = self._results.pop(member)
        if isinstance(result, BaseException):
            raise result
        return result

    def _all_ready(self) -> bool:
        return all(g in self._pending or not self.has_work[g]() for g in range(self.dp_size))

    def _run(self, taken: dict[int, SchedulerOutput]) -> dict[int, torch.Tensor | BaseException]:
        step = DPStep([taken.get(g) for g in range(self.dp_size)])
        try:
            logits = self.driver.forward(step)
        except Exception as exc:  # every member in the step fails it (a broken group, ...)
            return dict.fromkeys(taken, exc)
        per_group = logits.split(step.shape().sampled)
        return {g: per_group[g] for g in taken}

    def close(self) -> None:
        self.driver.close()


class _MemberRunner:
    """A member engine's runner: its steps go through the stepper."""

    def __init__(self, stepper: DPStepper, member: int) -> None:
        self.stepper, self.member = stepper, member

    def forward(self, batch: SchedulerOutput) -> torch.Tensor:
        return self.stepper.forward(self.member, batch)

    def close(self) -> None:
        if self.member == 0:  # member 0 owns the rank group (and the followers)
            self.stepper.close()


class DPPages:
    """The members' page managers, as the worker's leak detector and KV-event stream read them."""

    def __init__(self, members: list[Engine]) -> None:
        self.members = members
        self.page_size = members[0].pages.page_size
        self._lock = threading.Lock()
        self._held: Counter[int] = Counter()  # page hash -> groups caching it
        self._listeners: list = []
        self._watching = False

    @property
    def used_pages(self) -> int:
        return sum(m.pages.used_pages for m in self.members)

    @property
    def cache(self):
        return self.members[0].pages.cache

    def pages_by_room(self) -> dict[str, int]:
        merged: dict[str, int] = {}
        for member in self.members:
            merged.update(member.pages.pages_by_room())
        return merged

    def watch_cache(self, listener) -> list[int]:
        """As PageManager.watch_cache, over every group: a hash is stored while any group caches it."""
        with self._lock:
            if not self._watching:
                self._watching = True
                for member in self.members:
                    self._held.update(member.pages.watch_cache(self._changed))
            self._listeners.append(listener)
            return list(self._held)

    def unwatch_cache(self, listener) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def _changed(self, kind: str, hashes: list[int]) -> None:
        with self._lock:
            if kind == "stored":
                news = [h for h in hashes if self._held[h] == 0]
                self._held.update(hashes)
            else:
                self._held.subtract(hashes)
                news = [h for h in hashes if self._held[h] <= 0]
                for h in news:
                    del self._held[h]
            listeners = list(self._listeners)
        if news:
            for listener in listeners:
                listener(kind, news)


class DPEngine:
    """The Engine API over D member engines (see the module doc)."""

    def __init__(self, members: list[Engine], group_pools: list | None = None) -> None:
        self.members = members
        first = members[0]
        # Each group's KV pool as rank 0 reaches it: rank 0's own for group 0, a view over the
        # group's ranks (libkv.landing.RankGroupPool) for the others: poison, landing checksums and
        # KV transfer of a room go to its group's pool.
        self.group_pools = group_pools or [first.pool] * len(members)
        self.config, self.model_config, self.model = first.config, first.model_config, first.model
        self.tokenizer, self.pool, self.kv_layout = first.tokenizer, first.pool, first.kv_layout
        self.pages = DPPages(members)
        self._rooms: dict[str, Engine] = {}
        self.placed = [0] * len(members)  # requests placed on each group since start
        self._next_turn = 0  # the group a tie goes to next
        self._lock = threading.Lock()

    @classmethod
    def load(cls, config: EngineConfig) -> DPEngine:
        loaded = load(config)
        dp_size = config.topology().dp_size
        stepper = DPStepper(loaded.runner, dp_size)
        members = [Engine(replace(loaded,
                                  pages=(loaded.pages if g == 0
                                         else _page_manager(loaded.config, loaded.pool)),
                                  runner=_MemberRunner(stepper, g),
                                  followers=loaded.followers if g == 0 else None))
                   for g in range(dp_size)]
        for g, member in enumerate(members):
            stepper.has_work[g] = member.scheduler.has_work
        return cls(members,
                   _group_pools(loaded.pool, loaded.followers, config.topology().attn_tp_size, dp_size))

    @property
    def tp_followers(self) -> FollowerRanks | None:
        return self.members[0].tp_followers

    @property
    def hicache(self) -> None:
        """The store tier runs on one rank only (refused with DP attention at start)."""
        return None

    @property
    def step_clock(self) -> None:
        """None: the members step jointly, so no one member's clock is the worker's."""
        return None

    def start(self) -> None:
        for member in self.members:
            member.start()

    def shutdown(self, *, exiting: bool = False) -> None:
        for member in reversed(self.members):  # member 0 last: it closes the rank group
            member.shutdown(exiting=exiting)

    def check(self, request: EngineRequest) -> EngineRequest:
        return self.members[0].check(request)

    async def prepare(self, request: EngineRequest) -> EngineRequest:
        return await self.members[0].prepare(request)  # a compiled grammar serves every member

    async def generate(self, request: EngineRequest) -> AsyncIterator[list[TokenOutput]]:
        """On the group holding the room's reservation (a prefilled request on a decode worker),
        else on the group `_place` picks."""
        with self._lock:  # placed and counted at once: concurrent requests see each other
            member = self._rooms.get(request.room) or self._place(request.prompt_ids)
            self._assign(request.room, member)
        try:
            async for batch in member.generate(request):
                yield batch
        finally:
            # A prefill-only request's pages stay held under the room until `release`, which must
            # find its group; any other request's room ends with its stream.
            if not request.prefill_only:
                self._forget(request.room, member)

    # ---- PD: pages reserved for a prompt whose K/V arrives by transfer ---------------------
    def reserve_prompt(self, room: str, prompt_ids: list[int], hashes: list[int] | None = None):
        """Engine.reserve_prompt on the group `_place` picks (the prefix-cache hit counts); the room
        stays on that group until it is released or its prefilled request finishes."""
        with self._lock:
            member = self._rooms.get(room) or self._place(prompt_ids)
            reservation = member.reserve_prompt(room, prompt_ids, hashes)
            if reservation is not None:
                self._assign(room, member)
        return reservation

    def reserve(self, room: str, num_tokens: int) -> list[int] | None:
        with self._lock:
            member = self._rooms.get(room) or self._place([])
            pages = member.reserve(room, num_tokens)
            if pages is not None:
                self._assign(room, member)
        return pages

    def pages_freed(self) -> AbstractContextManager[asyncio.Event]:
        """Engine.pages_freed over every group: pages freed on any group may let a reservation in."""
        return pages_freed_event([member.pages for member in self.members])

    def release(self, room: str) -> bool:
        with self._lock:
            member = self._rooms.get(room)
        if member is None:
            return False
        released = member.release(room)
        self._forget(room, member)
        return released

    def group_of(self, room: str) -> int | None:
        """The DP group a room's request or reservation is on; None when it is on none."""
        with self._lock:
            member = self._rooms.get(room)
        return None if member is None else self.members.index(member)

    def pool_for(self, room: str):
        """The KV pool (as rank 0 reaches it) holding the room's pages; KeyError when the room is on
        no group (its pages were released)."""
        group = self.group_of(room)
        if group is None:
            raise KeyError(f"room {room!r} holds no pages on this worker")
        return self.group_pools[group]

    def _assign(self, room: str, member: Engine) -> None:
        """Record the room on `member` (under the lock), counting a new placement."""
        if self._rooms.get(room) is not member:
            self._rooms[room] = member
            g = self.members.index(member)
            self.placed[g] += 1
            self._next_turn = (g + 1) % len(self.members)

    def _forget(self, room: str, member: Engine) -> None:
        with self._lock:
            if self._rooms.get(room) is member:
                del self._rooms[room]

    def _place(self, prompt_ids: list[int]) -> Engine:
        """The group with the longest cached prefix of the prompt, then the fewest live requests
        (placed here and not finished), then the fewest used pages, then the next in turn after the
        last placement (round robin: requests that arrive one at a time, each finished before the
        next, still spread over the groups instead of all landing on group 0)."""
        hashes = page_hashes(prompt_ids, self.pages.page_size) if self.pages.cache is not None else None
        live = Counter(id(member) for member in self._rooms.values())
        size = len(self.members)

        def rank(g: int) -> tuple:
            member = self.members[g]
            hit = member.pages.cached_prefix_pages(prompt_ids, hashes) if hashes else 0
            return -hit, live[id(member)], member.pages.used_pages, (g - self._next_turn) % size

        return self.members[min(range(size), key=rank)]

    def abort(self, room: str) -> None:
        """Engine.abort on the room's group (every group when it is on none). The room is forgotten:
        an aborted request's pages are freed by the abort (a prefill-only one's included)."""
        with self._lock:
            member = self._rooms.get(room)
        for target in [member] if member is not None else self.members:
            target.abort(room)
        if member is not None:
            self._forget(room, member)

    def prompt_hashes(self, prompt_ids: list[int], images=()) -> list[int] | None:
        return self.members[0].prompt_hashes(prompt_ids, images)

    def stats(self) -> EngineStats:
        each = [member.stats() for member in self.members]
        return EngineStats(**{f.name: sum(getattr(s, f.name) for s in each) for f in fields(EngineStats)})

    def expert_load(self) -> ExpertLoad | None:
        """Rank 0's MoE layers run every group's rows: its counts are the worker's."""
        return self.members[0].expert_load()


def _group_pools(pool, followers, attn_tp_size: int, dp_size: int) -> list:
    """Group 0's pool is rank 0's (over its group's ranks, engine.tp.load); group g's a view over
    world ranks g * attn_tp_size onwards, reached through their control channels."""
    controls = followers.controls  # world ranks 1..N-1
    return [pool, *(RankGroupPool(pool.layout, pool.num_pages,
                                  controls[g * attn_tp_size - 1:(g + 1) * attn_tp_size - 1])
                    for g in range(1, dp_size))]


def load_engine(config: EngineConfig) -> EngineAPI:
    """The engine a worker runs: one Engine, or a DPEngine under --enable-dp-attention."""
    if config.topology().dp_size > 1:
        return DPEngine.load(config)
    return Engine.load(config)

