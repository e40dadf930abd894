"""Engine: the in-process async API over the scheduler, model runner and sampler.

One entry point: `generate(request)` streams an EngineRequest's outputs (its three kinds, plain,
prefilled and prefill-only, are in engine.request) as lists of TokenOutput. `check(request)` is a
request's one validation: a caller runs it where it builds the request (a worker, when it parses
one off the wire), and `generate` trusts it.

The forward loop runs in one background thread (engine/engine_thread.py: its threading protocol);
this class is the callers' side: it builds each request's state, posts it to the thread and
streams its outputs back on the caller's loop.

Text is made on the caller's side (engine.stream): the engine thread emits token ids and ends a
request on token-level conditions (a stop token, eos, length); each caller's stream detokenizes
and checks stop strings on its own loop, and when a stop string ends the output it tells the
engine to finish the request (`Finish`). Tokens the engine sampled meanwhile are dropped.
`reserve` and `release` act on the page manager directly (it has its own lock): they touch only
pages that no forward pass uses.

PD hooks: the prefill side runs a prefill-only request (pages held after it until `release`);
the decode side calls `reserve_prompt`, lets the transfer fill the pages, then runs a prefilled
request. Loading (weights, pool, tensor-parallel ranks) is engine.loading's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AbstractContextManager, aclosing, contextmanager
from dataclasses import replace
from typing import Any

import torch

from engine.config import EngineConfig
from engine.engine_thread import Abort, Add, Emit, EngineThread, Finish, RequestIO, Stop, Wake
from engine.grammar import GrammarCompiler, GrammarStats
from engine.loading import LoadedModel, load
from engine.models.moe import ExpertLoad, expert_load
from engine.models.vision import tower_merge_size
from engine.multimodal.inputs import ImageInput
from engine.multimodal.state import MultimodalState, page_salts
from engine.outputs import EngineStats, TokenOutput
from engine.page_manager import PageManager, Reservation
from engine.profiling import StepProfiler
from engine.request import EngineRequest
from engine.scheduler import Request, Scheduler, SchedulerConfig
from engine.stream import OutputStream, text_stream
from libkv.pool import KVPool
from libkv.store import StoreIdentity, StoreTier, create_client, model_digest
from pdserve.page_hash import page_hashes

log = logging.getLogger(__name__)

def open_store_tier(config: EngineConfig, pool: KVPool, pages: PageManager) -> StoreTier:
    """The store tier of --enable-hierarchical-cache, started (it connects in the background: a
    store that is not there yet only means computing without it)."""
    client = create_client(config.hicache_storage_backend, config.hicache_mooncake_master,
                           host=config.hicache_local_host,
                           segment_bytes=config.hicache_mooncake_segment_mb << 20,
                           timeout_s=config.hicache_timeout)
    identity = StoreIdentity(model_digest(config.model_path), pool.layout)
    return StoreTier(client, pool, identity, pages.retain, pages.free,
                     write_queue_pages=config.hicache_write_queue_pages).start()


@contextmanager
def pages_freed_event(managers: Sequence[PageManager]) -> Iterator[asyncio.Event]:
    """Engine.pages_freed over page managers (a DP engine's groups each have one)."""
    loop = asyncio.get_running_loop()
    event = asyncio.Event()

    def freed() -> None:  # on the thread that freed them (the engine thread, mostly)
        try:
            loop.call_soon_threadsafe(event.set)
        except RuntimeError:
            pass  # the waiter's loop is closed: nobody waits any more
    stops = [pages.on_freed(freed) for pages in managers]
    try:
        yield event
    finally:
        for stop in stops:
            stop()


class Engine:
    """A model, its KV pool and a scheduler behind an asyncio API (see the module docstring).

    Build with `Engine.load(config)`, then `start()`; `shutdown()` aborts what is left.
    """

    def __init__(self, loaded: LoadedModel) -> None:
        self.config = loaded.config
        self.model_config = loaded.model_config
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.pool = loaded.pool
        self.pages = loaded.pages
        self.kv_layout = loaded.pool.layout
        self.runner = loaded.runner
        self.tp_followers = loaded.followers
        self.scheduler = Scheduler(SchedulerConfig(
            max_running_requests=self.config.max_running_requests,
            chunked_prefill_size=self.config.chunked_prefill_size,
            max_seq_len=self.model_config.max_position_embeddings), self.pages)
        self.thread = EngineThread(self.scheduler, self.runner.forward, self.pages, self.pool.device,
                                   StepProfiler.from_config(self.config, self.pool.device),
                                   self.config.num_threads)
        self.step_clock = self.thread.step_clock
        self.hicache = open_store_tier(self.config, self.pool, self.pages) \
            if self.config.enable_hierarchical_cache else None
        self.scheduler.store = self.hicache
        self._grammars: GrammarCompiler | None = None

    @classmethod
    def load(cls, config: EngineConfig) -> Engine:
        """Load weights and tokenizer from `config.model_path` and size the KV pool."""
        return cls(load(config))

    @property
    def allocator(self):
        return self.pages.allocator

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def shutdown(self, *, exiting: bool = False) -> None:
        """Stop the engine thread after its current step; abort every live request. `exiting`: the
        process ends right after, without interpreter teardown (the store client is left to it)."""
        self.thread.stop()
        if self.tp_followers is not None:
            self._stop_followers()
        if self.hicache is not None:
            self.hicache.close(exiting=exiting)

    def _stop_followers(self) -> None:
        followers, self.tp_followers = self.tp_followers, None
        try:
            self.runner.close()
        except RuntimeError as exc:  # the group is broken (a rank died): nothing to tell
            log.warning("tp group already broken at shutdown: %s", exc)
            followers.kill()  # type: ignore[union-attr]
            return
        followers.stop()  # type: ignore[union-attr]

    # ---- caller API -----------------------------------------------------------------------------
    def check(self, request: EngineRequest) -> EngineRequest:
        """Return `request` if this engine can run it; ValueError otherwise, saying why: invalid
        sampling params, kinds mixed up (engine.request), or a prompt that could never fit the
        context or the KV pool. Thread-safe (it reads only what never changes)."""
        try:
            request.params.validate().check_vocab(self.model_config.vocab_size)
        except ValueError as exc:
            raise ValueError(f"invalid sampling params: {exc}") from None
        if request.prefill_only and request.first_token is not None:
            raise ValueError("a prefill-only request cannot start from a prefilled first token")
        if request.on_pages_filled is not None and not request.prefill_only:
            raise ValueError("on_pages_filled is the hook of a prefill-only request")
        new_tokens = 1 if request.prefill_only else request.params.max_new_tokens
        self.scheduler.check_fits(len(request.prompt_ids), new_tokens)
        if request.images:
            self._multimodal(request, checking=True)  # raises ValueError saying what does not match
        return request

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler of this model's tokenizer (made on first use)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                             self.model_config.eos_token_ids[0])
        return self._grammars

    async def prepare(self, request: EngineRequest) -> EngineRequest:
        """`request` with its structured output compiled, off the engine thread and bounded in time
        (engine.grammar); ValueError saying why a constraint cannot be used."""
        structured = request.params.structured
        if structured is None or request.grammar is not None:
            return request
        return replace(request, grammar=await self.grammars.prepare(structured))

    def _multimodal(self, request: EngineRequest, checking: bool = False) -> MultimodalState | None:
        """The request's multimodal state (None without images); ValueError for images this
        engine cannot take or that do not match the prompt's image-pad tokens. `checking`: a
        language-only engine's request may still lack the embeddings its caller fetches next."""
        if not request.images:
            return None
        config = self.model_config
        if not config.is_multimodal or config.image_token_id is None:
            raise ValueError(f"images sent to a text-only model ({config.architecture})")
        state = MultimodalState.build(request.prompt_ids, request.images, config.image_token_id,
                                      tower_merge_size(config), self.pages.page_size,
                                      mrope=config.mrope_section is not None)
        if request.image_embeddings is not None:  # EPD: an encoder service ran the tower
            if tuple(request.image_embeddings.shape) != (len(state.pad_positions), config.hidden_size):
                raise ValueError(f"image embeddings {tuple(request.image_embeddings.shape)} do not match the "
                                 f"prompt's {len(state.pad_positions)} image tokens of width "
                                 f"{config.hidden_size}")
            state.embeddings = request.image_embeddings.to(self.pool.device)  # they arrive in host memory
        elif self.model.vision is None and not checking:
            raise ValueError("this worker loads no vision tower (--language-only): images need embeddings "
                             "from an encoder service")
        return state

    async def generate(self, request: EngineRequest) -> AsyncIterator[list[TokenOutput]]:
        """Stream the outputs of a request that passed `check`. Each item is every output ready
        when the caller looks: one per step while the caller keeps up, several after it fell behind
        (so a server sends them in one message instead of one message per token); the last output
        has a finish reason. Leaving the iteration early aborts the request (a prefill-only
        request with `on_pages_filled` is stopped with its pages kept: engine.request). Raises
        ValueError when the room is in use here, and for a prefilled request whose reserved pages
        are missing (KeyError) or cannot hold the prompt."""
        if not self.thread.started:
            raise RuntimeError("engine not started")
        state = self._new_request(request)
        text = None if request.prefill_only else text_stream(
            self.tokenizer, request.params, request.prompt_ids, self.model_config.eos_token_ids)
        stream = OutputStream(text)
        self.thread.post(Add(state, self._new_io(request, self.thread.emitter(stream.loop, stream.put)),
                             request.first_token))
        try:
            async with aclosing(stream.batches(lambda: self.thread.post(Finish(request.room)))) as batches:
                async for batch in batches:
                    yield batch
        finally:
            if not stream.done:
                self.thread.post(Stop(request.room) if request.on_pages_filled is not None
                                 else Abort(request.room))

    def add_unstreamed(self, request: EngineRequest) -> None:
        """Add a checked request whose outputs nobody reads, for a benchmark that drives
        `thread.step()` by hand with the thread not started."""
        if self.thread.started:
            raise RuntimeError("add_unstreamed is for an engine whose steps are driven by hand")
        self.thread.add(self._new_request(request), self._new_io(request, lambda item: None),
                        request.first_token)

    def abort(self, room: str) -> None:
        """Finish the request with "abort" and free its pages (also a prefill's held pages)."""
        self.thread.post(Abort(room))

    def reserve(self, room: str, num_tokens: int) -> list[int] | None:
        """Pre-allocate pages for a prompt of `num_tokens` whose K/V will arrive by transfer."""
        return self.pages.reserve(room, num_tokens)

    def reserve_prompt(self, room: str, prompt_ids: list[int],
                       hashes: list[int] | None = None) -> Reservation | None:
        """Like `reserve`, but the prompt's leading full pages come from the prefix cache when it
        holds them: only `Reservation.tail` must be filled by transfer. `hashes`: the prompt's
        page hashes (`prompt_hashes`), for a caller that tries again until pages are free."""
        return self.pages.reserve_prompt(room, prompt_ids, hashes)

    def prompt_hashes(self, prompt_ids: list[int], images: Sequence[ImageInput] = ()) -> list[int] | None:
        """The chained hashes of the prompt's full pages, salted by its `images` (expanded prompt)
        as the scheduler salts them; None when the prefix cache is off."""
        if self.pages.cache is None:
            return None
        image_token_id = self.model_config.image_token_id
        if not images or image_token_id is None:  # a text-only model's images are refused by `check`
            return page_hashes(prompt_ids, self.pages.page_size)
        salts = page_salts(prompt_ids, images, image_token_id, tower_merge_size(self.model_config),
                           self.pages.page_size)
        return page_hashes(prompt_ids, self.pages.page_size, salts=salts)

    def pool_for(self, room: str):
        """The KV pool holding `room`'s pages: the engine's one pool (engine.dp_engine.DPEngine has
        one per DP group)."""
        return self.pool

    def pages_freed(self) -> AbstractContextManager[asyncio.Event]:
        """An event on the caller's loop, set whenever pages are given back while the block runs: a
        waiter for free pages clears it, tries to reserve, and waits for it (no polling)."""
        return pages_freed_event([self.pages])

    def release(self, room: str) -> bool:
        """Free the pages reserved or held under `room`; False if it has none."""
        released = self.pages.release(room)
        if released:
            self.thread.post(Wake())
        return released

    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        cache = self.pages.cache
        return EngineStats(
            waiting=len(scheduler.waiting), running=len(scheduler.running),
            retracted=scheduler.num_retracted_waiting, total_retractions=scheduler.num_retractions,
            used_pages=self.pages.used_pages, total_pages=self.pages.num_pages,
            held_rooms=self.pages.num_rooms, reserved_pages=self.pages.reserved_pages,
            running_tokens=sum(r.num_tokens for r in list(scheduler.running)),
            generated_tokens=self.thread.generated_tokens, steps=self.thread.steps,
            cached_pages=cache.num_pages if cache else 0,
            prefix_query_tokens=cache.stats.query_tokens if cache else 0,
            prefix_hit_tokens=cache.stats.hit_tokens if cache else 0,
            prefix_evicted_pages=cache.stats.evicted_pages if cache else 0,
            **self._grammar_stats())

    def _grammar_stats(self) -> dict[str, Any]:
        compiled = self._grammars.stats if self._grammars is not None else GrammarStats()
        return {"grammar_compiles": compiled.compiles, "grammar_compile_seconds": compiled.compile_seconds,
                "grammar_cache_hits": compiled.cache_hits, "grammar_refused": compiled.refused,
                "constrained_steps": self.thread.constraints.stats.constrained_steps}

    def expert_load(self) -> ExpertLoad | None:
        """Tokens routed to each expert since load (summed over layers) and the last step's
        imbalance; None for a dense model. Any thread may read it: a step running meanwhile makes
        it at most one step stale. Under TP, rank 0's counts are every rank's (same router)."""
        return expert_load([layer.moe for layer in self.model.layers if layer.moe is not None])

    def _new_request(self, request: EngineRequest) -> Request:
        """The scheduler's record of a caller's request (ValueError for images it cannot take)."""
        state = Request(room=request.room, token_ids=list(request.prompt_ids),
                        num_prompt=len(request.prompt_ids), prefill_only=request.prefill_only,
                        multimodal=self._multimodal(request))
        if request.first_token is not None:
            state.token_ids.append(request.first_token.token_id)
            state.num_computed = state.num_prompt
        return state

    def _new_io(self, request: EngineRequest, emit: Emit) -> RequestIO:
        """What the engine thread keeps of a caller's request beside the scheduler's record."""
        params = request.params
        stop_token_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(self.model_config.eos_token_ids))
        generator = torch.Generator(device=self.pool.device) if params.seed is not None else None
        grammar = request.grammar
        if grammar is None and params.structured is not None:  # a caller that did not `prepare`
            grammar = self.grammars.compile(params.structured)
        return RequestIO(emit, params, stop_token_ids, generator, request.on_pages_filled,
                         grammar=grammar.new_request() if grammar is not None else None,
                         carried_tokens=request.carried_tokens)
