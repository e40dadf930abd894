"""EngineAPI: the one engine interface a worker uses, whether it runs one Engine (engine/engine.py) or
a DP attention worker's groups (engine/dp_engine.py's DPEngine). mypy checks that both implement
it; services type their engine as this protocol, never as one of the two classes.

Who calls what, in which state: the worker's runtime loads and starts it (`load_engine`, `start`)
and stops it last (`shutdown`); a servicer checks each request (`check`) then streams it
(`generate`), ends it early (`abort`), and in PD reserves pages for a prompt whose KV arrives by
transfer (`reserve_prompt`, waiting on `pages_freed` while none are free) and gives them back
(`release`). Metrics, the leak detector and KV events read `stats`, `pages` and `expert_load`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.models.config import ModelConfig
    from engine.models.moe import ExpertLoad
    from engine.multimodal.inputs import ImageInput
    from engine.outputs import EngineStats, TokenOutput
    from engine.page_manager import PrefixCache, Reservation
    from engine.request import EngineRequest
    from engine.step_clock import StepClock
    from engine.tp.ranks import FollowerRanks
    from libkv.landing import LandingPool
    from libkv.layout import KVLayout
    from libkv.pool import KVPool
    from libkv.store import StoreTier

CacheListener = Callable[[str, list[int]], None]  # (kind: "stored" | "removed", page hashes)


class PageView(Protocol):
    """Who holds which pages, as the leak detector and the KV-event stream read it: one page
    manager, or a DP engine's groups together."""

    @property
    def page_size(self) -> int: ...

    @property
    def used_pages(self) -> int: ...

    @property
    def cache(self) -> PrefixCache | None: ...

    def pages_by_room(self) -> dict[str, int]: ...

    def watch_cache(self, listener: CacheListener) -> list[int]: ...

    def unwatch_cache(self, listener: CacheListener) -> None: ...


class EngineAPI(Protocol):
    """See the module docstring; each method's contract is on Engine's."""

    @property
    def config(self) -> EngineConfig: ...

    @property
    def model_config(self) -> ModelConfig: ...

    @property
    def pool(self) -> KVPool: ...

    @property
    def kv_layout(self) -> KVLayout: ...

    @property
    def pages(self) -> PageView: ...

    @property
    def tp_followers(self) -> FollowerRanks | None: ...

    @property
    def hicache(self) -> StoreTier | None: ...

    @property
    def step_clock(self) -> StepClock | None: ...

    def start(self) -> None: ...

    def shutdown(self, *, exiting: bool = False) -> None: ...

    def check(self, request: EngineRequest) -> EngineRequest: ...

    async def prepare(self, request: EngineRequest) -> EngineRequest: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[list[TokenOutput]]: ...

    def abort(self, room: str) -> None: ...

    def reserve_prompt(self, room: str, prompt_ids: list[int],
                       hashes: list[int] | None = None) -> Reservation | None: ...

    def prompt_hashes(self, prompt_ids: list[int], images: Sequence[ImageInput] = ()) -> list[int] | None: ...

    def pages_freed(self) -> AbstractContextManager[asyncio.Event]: ...

    def pool_for(self, room: str) -> LandingPool: ...

    def release(self, room: str) -> bool: ...

    def stats(self) -> EngineStats: ...

    def expert_load(self) -> ExpertLoad | None: ...
