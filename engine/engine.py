"""Engine: the in-process async API over the scheduler, model runner and sampler.

One entry point: `generate(request)` streams an EngineRequest's outputs (its three kinds, plain,
prefilled and prefill-only, are in engine.request) as lists of TokenOutput. `check(request)` is a
request's one validation: a caller runs it where it builds the request (a worker, when it parses
one off the wire), and `generate` trusts it.

Threading protocol. The forward loop runs in ONE background thread (`start()`); torch releases
the GIL during the heavy ops, so an asyncio server keeps serving while it runs. Callers on any
asyncio loop submit work through a thread-safe inbox of commands; the engine thread applies
them only between steps, so a request is never freed while a forward pass uses its pages.
Results go back with `loop.call_soon_threadsafe`, batched once per step and loop: one wake-up of
each caller loop per step, however many requests it streams.

Text is made on the caller's side (engine.stream): the engine thread emits token ids and ends a
request on token-level conditions (a stop token, eos, length); each caller's stream detokenizes
and checks stop strings on its own loop, and when a stop string ends the output it tells the
engine to finish the request (`_Finish`). Tokens the engine sampled meanwhile are dropped.
`reserve` and `release` act on the page manager directly (it has its own lock): they touch only
pages that no forward pass uses.

PD hooks: the prefill side runs a prefill-only request (pages held after it until `release`);
the decode side calls `reserve_prompt`, lets the transfer fill the pages, then runs a prefilled
request. Loading (weights, pool, tensor-parallel ranks) is engine.loading's.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import AbstractContextManager, aclosing, contextmanager
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.loading import LoadedModel, load
from engine.models.moe import ExpertLoad, expert_load
from engine.models.vision import tower_merge_size
from engine.multimodal.inputs import ImageInput
from engine.multimodal.state import MultimodalState, page_salts
from engine.outputs import EngineStats, FirstToken, TokenOutput
from engine.page_manager import PageManager, Reservation
from engine.profiling import StepProfiler
from engine.request import EngineRequest
from engine.sampling import sample
from engine.scheduler import Request, Scheduler, SchedulerConfig, SchedulerOutput
from engine.step_clock import StepClock
from engine.stream import OutputStream, text_stream
from libkv.pool import KVPool
from libkv.store import StoreIdentity, StoreTier, create_client, model_digest
from pdserve.page_hash import page_hashes

log = logging.getLogger(__name__)

# ---- inbox commands (caller thread -> engine thread) ------------------------------------------


@dataclass(frozen=True)
class _Add:
    request: Request
    first_token: FirstToken | None  # set: the prompt's K/V is in the pages reserved under the room


@dataclass(frozen=True)
class _Abort:
    room: str


@dataclass(frozen=True)
class _Stop:
    """The caller of a prefill with a transfer hook stopped listening: stop the request but keep
    its pages held under the room, since transfers may still be reading them (engine.request)."""

    room: str


@dataclass(frozen=True)
class _Finish:
    """The caller found a stop string: finish the request without emitting anything more."""

    room: str


@dataclass(frozen=True)
class _Wake:
    """Pages were released elsewhere: waiting requests may fit now."""


_Command = _Add | _Abort | _Stop | _Finish | _Wake


def open_store_tier(config: EngineConfig, pool: KVPool, pages: PageManager) -> StoreTier:
    """The store tier of --enable-hierarchical-cache, started (it connects in the background: a
    store that is not there yet only means computing without it)."""
    client = create_client(config.hicache_storage_backend, config.hicache_mooncake_master,
                           host=config.hicache_local_host, segment_bytes=config.hicache_mooncake_segment_mb << 20,
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


def step_seed(seed: int, index: int) -> int:
    """Seed of the generator that samples a request's `index`-th token.

    Seeding by (request seed, token index) instead of keeping one generator running makes a
    seeded request's tokens independent of how it was run: retracted and recomputed, or
    prefilled on one worker and decoded on another, it samples the same tokens.
    """
    return (seed * 0x9E3779B1 + index * 0x85EBCA77 + 1) % (2**63 - 1)


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
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._deliveries: dict[asyncio.AbstractEventLoop, list[tuple[Callable, object]]] = defaultdict(list)
        self._generated_tokens = 0
        self._steps = 0
        self.step_clock = StepClock()
        self.profiler = StepProfiler.from_config(self.config, self.pool.device)
        self.hicache = open_store_tier(self.config, self.pool, self.pages) \
            if self.config.enable_hierarchical_cache else None
        self.scheduler.store = self.hicache

    @classmethod
    def load(cls, config: EngineConfig) -> Engine:
        """Load weights and tokenizer from `config.model_path` and size the KV pool."""
        return cls(load(config))

    @property
    def allocator(self):
        return self.pages.allocator

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("engine already started")
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, *, exiting: bool = False) -> None:
        """Stop the engine thread after its current step; abort every live request. `exiting`: the
        process ends right after, without interpreter teardown (the store client is left to it)."""
        self._stopping.set()
        self._inbox.put(_Wake())
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._apply_inbox(block=False)
        for room in list(self.scheduler.requests):
            self._abort(room)
        self._deliver()
        if self.tp_followers is not None:
            self._stop_followers()
        if self.hicache is not None:
            self.hicache.close(exiting=exiting)

    def _stop_followers(self) -> None:
        followers, self.tp_followers = self.tp_followers, None
        try:
            self.runner.close()  # type: ignore[union-attr]
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
            request.params.validate()
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

    def _multimodal(self, request: EngineRequest, checking: bool = False) -> MultimodalState | None:
        """The request's multimodal state (None without images); ValueError for images this
        engine cannot take or that do not match the prompt's image-pad tokens. `checking`: a
        language-only engine's request may still lack the embeddings its caller fetches next."""
        if not request.images:
            return None
        config = self.model_config
        if not config.is_multimodal:
            raise ValueError(f"images sent to a text-only model ({config.architecture})")
        state = MultimodalState.build(request.prompt_ids, request.images, config.image_token_id,
                                      tower_merge_size(config), self.pages.page_size,
                                      mrope=config.mrope_section is not None)
        if request.image_embeddings is not None:  # EPD: an encoder service ran the tower
            if tuple(request.image_embeddings.shape) != (len(state.pad_positions), config.hidden_size):
                raise ValueError(f"image embeddings {tuple(request.image_embeddings.shape)} do not match the "
                                 f"prompt's {len(state.pad_positions)} image tokens of width {config.hidden_size}")
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
        if self._thread is None:
            raise RuntimeError("engine not started")
        state = self._new_request(request)
        text = None if request.prefill_only else text_stream(
            self.tokenizer, request.params, request.prompt_ids, self.model_config.eos_token_ids)
        stream = OutputStream(text)
        state.emit = lambda item: self._deliveries[stream.loop].append((stream.put, item))
        self._inbox.put(_Add(state, request.first_token))
        try:
            async with aclosing(stream.batches(lambda: self._inbox.put(_Finish(request.room)))) as batches:
                async for batch in batches:
                    yield batch
        finally:
            if not stream.done:
                self._inbox.put(_Stop(request.room) if request.on_pages_filled is not None
                                else _Abort(request.room))

    def abort(self, room: str) -> None:
        """Finish the request with "abort" and free its pages (also a prefill's held pages)."""
        self._inbox.put(_Abort(room))

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
        salts = page_salts(prompt_ids, images, self.model_config.image_token_id, tower_merge_size(self.model_config),
                           self.pages.page_size) if images else ()
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
            self._inbox.put(_Wake())
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
            generated_tokens=self._generated_tokens, steps=self._steps,
            cached_pages=cache.num_pages if cache else 0,
            prefix_query_tokens=cache.stats.query_tokens if cache else 0,
            prefix_hit_tokens=cache.stats.hit_tokens if cache else 0,
            prefix_evicted_pages=cache.stats.evicted_pages if cache else 0)

    def expert_load(self) -> ExpertLoad | None:
        """Tokens routed to each expert since load (summed over layers) and the last step's
        imbalance; None for a dense model. Any thread may read it: a step running meanwhile makes
        it at most one step stale. Under TP, rank 0's counts are every rank's (same router)."""
        return expert_load([layer.moe for layer in self.model.layers if layer.moe is not None])

    def _new_request(self, request: EngineRequest) -> Request:
        """The engine's own state of a caller's request (the scheduler's Request)."""
        params = request.params
        state = Request(room=request.room, token_ids=list(request.prompt_ids), num_prompt=len(request.prompt_ids),
                        params=params, prefill_only=request.prefill_only, on_pages_filled=request.on_pages_filled,
                        multimodal=self._multimodal(request))
        if params.seed is not None:
            state.generator = torch.Generator(device=self.pool.device)
        state.stop_token_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(self.model_config.eos_token_ids))
        if request.first_token is not None:
            state.token_ids.append(request.first_token.token_id)
            state.num_computed = state.num_prompt
        return state

    # ---- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)  # the intra-op pool size is per thread
        busy = False
        while not self._stopping.is_set():
            # Block for commands when idle, or when the last step found nothing it could run
            # (e.g. waiting requests need pages that PD holds): `release` posts a wake-up.
            self._apply_inbox(block=not busy or not self.scheduler.has_work())
            self._deliver()  # e.g. the first token of a request that joined prefilled
            try:
                busy = self.step()
            except Exception:
                log.exception("engine step failed; aborting every live request")
                for room in list(self.scheduler.requests):
                    self._abort(room)
                busy = False
            self._deliver()

    def _apply_inbox(self, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(command, _Add):
                self._add(command.request, command.first_token)
            elif isinstance(command, _Abort):
                self._abort(command.room)
            elif isinstance(command, _Stop):
                self._stop(command.room)
            elif isinstance(command, _Finish):
                request = self.scheduler.requests.get(command.room)
                if request is not None:
                    self.scheduler.finish(request, "stop")
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, request: Request, first_token: FirstToken | None) -> None:
        """Take a new request, or refuse it through its stream. A room names one request at a time:
        one the scheduler has, or one with pages reserved or held under it, is in use, except by
        the prefilled request those reserved pages are for, which takes them over (or, refused,
        frees them: nobody else would)."""
        room = request.room
        try:
            if room in self.scheduler.requests or (first_token is None and self.pages.has_room(room)):
                raise ValueError(f"room {room!r} is already in use")
            if first_token is not None:
                request.page_ids = self._take_reservation(request)
        except (KeyError, ValueError) as refused:
            if first_token is not None:
                self.pages.release(room)
            request.emit(refused)  # the caller's stream raises it
            return
        if first_token is None:
            self.scheduler.add(request)
            return
        self.scheduler.add_running(request)
        self._emit_token(request, first_token.logprob, first_token.top_logprobs)

    def _take_reservation(self, request: Request) -> list[int]:
        pages = self.pages.take_reserved(request.room)
        if len(pages) < self.pages.pages_for(request.num_prompt):
            self.pages.free(pages)
            raise ValueError(f"room {request.room!r}: {len(pages)} reserved pages cannot hold a prompt "
                             f"of {request.num_prompt} tokens")
        return pages

    @torch.inference_mode()
    def step(self) -> bool:
        """Schedule and run one forward pass, then sample and emit. False when there was nothing to do."""
        began = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return False
        kind = StepClock.kind_of(len(batch.decodes), len(batch.extends))
        if self.profiler.active:  # off after its bounded steps: this check is all it costs then
            ran = self.profiler.run(batch, self._run_step)
        else:
            ran = self._run_step(batch)
        self.step_clock.record(kind, time.perf_counter() - began, len(batch.decodes))
        return ran

    def _run_step(self, batch: SchedulerOutput) -> bool:
        """Forward, sample and emit one scheduled batch (inside `step`'s inference mode)."""
        logits = self.runner.forward(batch)
        self.scheduler.advance(batch)
        self._steps += 1
        self._report_filled_pages(batch)
        chunks = batch.sampled_chunks()
        if not chunks:
            return True
        requests = [self.scheduler.requests[c.room] for c in chunks]
        generators = []
        for request in requests:
            if request.generator is not None:
                request.generator.manual_seed(step_seed(request.params.seed, request.num_generated))
            generators.append(request.generator)
        result = sample(logits, [r.params for r in requests], generators)
        token_ids = result.token_ids.tolist()
        for row, request in enumerate(requests):
            logprob, top = result.logprobs_of(row, request.params)
            request.token_ids.append(token_ids[row])
            if request.prefill_only:
                self._finish_prefill(request, logprob, top)
            else:
                self._emit_token(request, logprob, top)
        return True

    def _emit_token(self, request: Request, logprob: float | None, top: list[tuple[int, float]]) -> None:
        """Emit the request's newest token (text is added by the caller's stream) and finish the
        request if a token-level condition ends it here: a stop token or eos ("stop"), or length."""
        token = request.token_ids[-1]
        self._generated_tokens += 1
        reason = None
        if token in request.stop_token_ids:
            reason = "stop"
        elif request.num_generated >= request.params.max_new_tokens or \
                request.num_tokens >= self.scheduler.config.max_seq_len:
            reason = "length"
        request.emit(_output(request, token, logprob, top, reason))
        if reason is not None:
            self.scheduler.finish(request, reason)

    def _finish_prefill(self, request: Request, logprob: float | None, top: list[tuple[int, float]]) -> None:
        """A prefill-only request sampled its first token: report all its pages, hold them under the
        room and emit the token as its one output."""
        self._call_pages_filled(request, request.page_ids[:self.pages.pages_for(request.num_prompt)],
                                request.num_prompt)
        if request.room not in self.scheduler.requests:  # the hook failed: stopped, with an abort output
            return
        self.scheduler.finish(request, "stop")
        request.emit(_output(request, request.token_ids[-1], logprob, top, "stop"))

    def _report_filled_pages(self, batch: SchedulerOutput) -> None:
        if self.pool.device.type == "cuda":
            torch.cuda.current_stream(self.pool.device).synchronize()  # K/V written before a transfer reads
        for chunk in batch.extends:
            request = self.scheduler.requests.get(chunk.room)
            if request is None or not request.prefill_only or chunk.sample:
                continue  # the final chunk reports in _finish_prefill, with its partial page
            full = request.num_computed // self.pages.page_size
            if full > request.pages_reported:
                self._call_pages_filled(request, request.page_ids[:full], request.num_computed)

    def _call_pages_filled(self, request: Request, page_ids: list[int], num_tokens: int) -> None:
        request.pages_reported = len(page_ids)
        if request.on_pages_filled is None:
            return
        try:
            request.on_pages_filled(list(page_ids), num_tokens)
        except Exception:
            log.exception("room %s: on_pages_filled failed; stopping the prefill", request.room)
            self._stop(request.room)  # earlier writes may still read the pages: the caller frees them

    def _abort(self, room: str) -> None:
        request = self.scheduler.abort(room)
        self.pages.release(room)  # a finished prefill's held pages, or an unused reservation
        if request is not None:
            request.emit(_output(request, -1, None, [], "abort"))

    def _stop(self, room: str) -> None:
        request = self.scheduler.requests.get(room)
        if request is None:
            return  # finished: a prefill's pages are held already, or it was aborted
        self.scheduler.finish(request, "abort", keep_pages=True)
        request.emit(_output(request, -1, None, [], "abort"))

    def _deliver(self) -> None:
        deliveries, self._deliveries = self._deliveries, defaultdict(list)
        for loop, items in deliveries.items():
            try:
                loop.call_soon_threadsafe(_deliver_all, items)
            except RuntimeError:
                pass  # the caller's loop is closed: nobody is listening any more


def _output(request: Request, token: int, logprob: float | None, top: list[tuple[int, float]],
            reason: str | None) -> TokenOutput:
    """An output of `request` (text is added by the caller's stream); token -1: an abort."""
    return TokenOutput(token_id=token, text="", logprob=logprob, top_logprobs=top, finish_reason=reason,
                       prompt_tokens=request.num_prompt, completion_tokens=request.num_generated)


def _deliver_all(items: list[tuple[Callable, object]]) -> None:
    for put, item in items:
        put(item)
