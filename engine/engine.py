"""Engine: the in-process async API over the scheduler, model runner and sampler.

Threading protocol. The forward loop runs in ONE background thread (`start()`); torch releases
the GIL during the heavy ops, so an asyncio server keeps serving while it runs. Callers on any
asyncio loop submit work through a thread-safe inbox of commands; the engine thread applies
them only between steps, so a request is never freed while a forward pass uses its pages.
Results go back with `loop.call_soon_threadsafe`, batched once per step and loop: one wake-up of
each caller loop per step, however many requests it streams.

Text is made on the caller's side: the engine thread emits token ids and ends a request on
token-level conditions (a stop token, eos, length); each caller's stream detokenizes and checks
stop strings on its own loop, and when a stop string ends the output it tells the engine to
finish the request (`_Finish`). Tokens the engine sampled meanwhile are dropped.
`reserve` and `release` act on the page manager directly (it has its own lock): they touch only
pages that no forward pass uses.

PD hooks: the prefill side calls `prefill` (pages held after it returns until `release`); the
decode side calls `reserve` (or `reserve_prompt`, reusing cached leading pages), lets the
transfer fill the pages, then `generate_prefilled`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import torch

from engine.batch import SchedulerOutput
from engine.config import EngineConfig
from engine.detokenizer import TextStream
from engine.memory import kv_pages
from engine.model_runner import ModelRunner
from engine.models.config import ModelConfig, resolve_dtype
from engine.models.decoder import DecoderModel
from engine.models.layer_ops import select_layer_ops
from engine.outputs import EngineStats, FirstToken, PrefillResult, RequestAborted, TokenOutput
from engine.page_manager import PageManager, Reservation
from engine.request import Request
from engine.sampling import SamplingParams, sample
from engine.scheduler import Scheduler, SchedulerConfig
from engine.tp.ranks import FollowerRanks
from engine.tp.runner import DriverRunner
from libkv.layout import KVLayout
from libkv.pool import KVPool
from pdserve.page_hash import page_hashes

log = logging.getLogger(__name__)
T = TypeVar("T")

# ---- inbox commands (caller thread -> engine thread) ------------------------------------------


@dataclass(frozen=True)
class _Add:
    request: Request


@dataclass(frozen=True)
class _AddPrefilled:
    request: Request
    first_token: FirstToken


@dataclass(frozen=True)
class _Abort:
    room: str


@dataclass(frozen=True)
class _Stop:
    """The caller of a prefill with a transfer hook stopped listening: stop the request but keep
    its pages held under the room, since transfers may still be reading them (see `prefill`)."""

    room: str


@dataclass(frozen=True)
class _Finish:
    """The caller found a stop string: finish the request without emitting anything more."""

    room: str


@dataclass(frozen=True)
class _Wake:
    """Pages were released elsewhere: waiting requests may fit now."""


_Command = _Add | _AddPrefilled | _Abort | _Stop | _Finish | _Wake


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

    def __init__(self, config: EngineConfig, model_config: ModelConfig, model: DecoderModel,
                 tokenizer, pool: KVPool, pages: PageManager) -> None:
        self.config = config
        self.model_config = model_config
        self.model = model
        self.tokenizer = tokenizer
        self.pool = pool
        self.pages = pages
        self.kv_layout: KVLayout = pool.layout
        self.runner: ModelRunner | DriverRunner = ModelRunner(model, pool)
        self.tp_followers: FollowerRanks | None = None  # ranks 1..N-1 when tensor-parallel
        self.scheduler = Scheduler(SchedulerConfig(
            max_running_requests=config.max_running_requests,
            chunked_prefill_size=config.chunked_prefill_size,
            max_seq_len=model_config.max_position_embeddings), pages)
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._live_rooms: set[str] = set()
        self._rooms_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._deliveries: dict[asyncio.AbstractEventLoop, list[tuple[Callable, object]]] = defaultdict(list)
        self._generated_tokens = 0
        self._steps = 0

    @classmethod
    def load(cls, config: EngineConfig) -> Engine:
        """Load weights and tokenizer from `config.model_path` and size the KV pool."""
        from transformers import AutoTokenizer

        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        device = torch.device(config.device)
        model_config = ModelConfig.from_dir(config.model_path)
        dtype = resolve_dtype(config.dtype, model_config)
        layout = KVLayout(num_layers=model_config.num_layers, num_kv_heads=model_config.num_kv_heads,
                          head_dim=model_config.head_dim, page_size=config.page_size,
                          dtype=str(dtype).removeprefix("torch."))

        layer_ops = select_layer_ops(config.cpu_kernels, device)
        if config.tp_size > 1:
            return cls._load_tensor_parallel(config, model_config, device)

        def load_tensors() -> tuple[DecoderModel, KVPool]:
            model = DecoderModel.load(config.model_path, model_config, dtype, device, layer_ops)
            pool = KVPool(layout, kv_pages(config, layout, device), device)
            return model, pool

        # The copies of loading run as parallel (OpenMP) regions, and the first one in a thread
        # gives that thread a pool of OpenMP workers for as long as it lives. Two such pools (the
        # caller's and the engine thread's) on a small machine make libgomp throttle its spinning:
        # a bf16 decode step of the small preset measured 25.9 ms instead of 21 ms. So the loading
        # happens in a short-lived thread whose workers go away with it.
        model, pool = _in_short_lived_thread(load_tensors)
        tokenizer = AutoTokenizer.from_pretrained(str(Path(config.model_path)))
        pages = PageManager(pool.num_pages, config.page_size, prefix_cache=not config.disable_radix_cache)
        return cls(config, model_config, model, tokenizer, pool, pages)

    @classmethod
    def _load_tensor_parallel(cls, config: EngineConfig, model_config: ModelConfig, device: torch.device) -> Engine:
        """Rank 0 of `config.tp_size`: start the follower ranks, load this rank's shard, drive the group."""
        from transformers import AutoTokenizer

        from engine.tp.load import load_rank
        from engine.tp.setup import prepare_config, start_tensor_parallel

        config = prepare_config(config, model_config)
        torch.set_num_threads(config.num_threads)
        group, followers = start_tensor_parallel(config, device)
        try:
            parts = _in_short_lived_thread(lambda: load_rank(config, device, group, followers.controls))
            tokenizer = AutoTokenizer.from_pretrained(str(Path(config.model_path)))
        except BaseException:
            followers.kill()
            raise
        # The prefix cache lives in rank 0's page manager only: followers run rank 0's plan (page
        # ids and start positions), so a page cached here holds its K/V head slice on every rank.
        engine = cls(config, model_config, parts.model, tokenizer, parts.pool,
                     PageManager(parts.pool.num_pages, config.page_size, prefix_cache=not config.disable_radix_cache))
        engine.runner = DriverRunner(parts.runner, group)
        engine.tp_followers = followers
        return engine

    @property
    def allocator(self):
        return self.pages.allocator

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("engine already started")
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the engine thread after its current step; abort every live request."""
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
    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       room: str) -> AsyncIterator[TokenOutput]:
        """Stream the tokens of one request. Leaving the iteration early aborts the request."""
        async with aclosing(self.generate_batches(prompt_ids, params, room)) as batches:
            async for batch in batches:
                for output in batch:
                    yield output

    async def generate_batches(self, prompt_ids: list[int], params: SamplingParams,
                               room: str) -> AsyncIterator[list[TokenOutput]]:
        """Like `generate`, but each item is every output ready when the caller looks: one per step
        while the caller keeps up, several after it fell behind (so a server sends them in one
        message instead of one message per token)."""
        params.validate()
        self.scheduler.check_fits(len(prompt_ids), params.max_new_tokens)
        self._claim_room(room)
        request = self._new_request(room, list(prompt_ids), params)
        async with aclosing(self._stream(request, _Add(request))) as batches:
            async for batch in batches:
                yield batch

    async def generate_prefilled(self, room: str, prompt_ids: list[int], first_token: FirstToken,
                                 params: SamplingParams) -> AsyncIterator[TokenOutput]:
        """Decode a request whose prompt K/V is already in the pages reserved under `room`.

        The first token (sampled by the prefill worker) is emitted first, then decoding continues
        in the running batch. The reservation becomes the request's pages (no `release` needed).
        """
        async with aclosing(self.generate_prefilled_batches(room, prompt_ids, first_token, params)) as batches:
            async for batch in batches:
                for output in batch:
                    yield output

    async def generate_prefilled_batches(self, room: str, prompt_ids: list[int], first_token: FirstToken,
                                         params: SamplingParams) -> AsyncIterator[list[TokenOutput]]:
        """`generate_prefilled`, batched as `generate_batches` is."""
        params.validate()
        self.scheduler.check_fits(len(prompt_ids), params.max_new_tokens)
        self._claim_room(room)
        try:
            pages = self.pages.take_reserved(room)
        except KeyError:
            self._release_room(room)
            raise
        if len(pages) < self.pages.pages_for(len(prompt_ids)):
            self.pages.free(pages)
            self._release_room(room)
            raise ValueError(f"room {room!r}: {len(pages)} reserved pages cannot hold a prompt "
                             f"of {len(prompt_ids)} tokens")
        request = self._new_request(room, list(prompt_ids), params)
        request.token_ids.append(first_token.token_id)
        request.page_ids = pages
        request.num_computed = len(prompt_ids)
        async with aclosing(self._stream(request, _AddPrefilled(request, first_token))) as batches:
            async for batch in batches:
                yield batch

    async def prefill(self, prompt_ids: list[int], params: SamplingParams, room: str,
                      on_pages_filled: Callable[[list[int], int], None] | None = None) -> PrefillResult:
        """Run a prompt and sample its first token; its pages stay held until `release(room)`.

        `on_pages_filled(page_ids, num_tokens_done)` is called from the engine thread after each
        chunk with the pages completely filled so far (in order), and once at the end with all
        the prompt's pages (the last one possibly partial). Raises RequestAborted if aborted.
        If the caller is cancelled, the request stops; with `on_pages_filled` its pages then stay
        held under `room` (writes of them may still be reading them) until the caller's
        `abort(room)` or `release(room)`, as after a finished prefill.
        """
        params.validate()
        self.scheduler.check_fits(len(prompt_ids), 1)
        self._claim_room(room)
        request = self._new_request(room, list(prompt_ids), params)
        request.prefill_only = True
        request.on_pages_filled = on_pages_filled
        result = None
        async with aclosing(self._stream(request, _Add(request))) as batches:
            async for batch in batches:
                result = batch[-1]
        if not isinstance(result, PrefillResult):
            raise RequestAborted(f"prefill of room {room!r} was aborted")
        return result

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

    def prompt_hashes(self, prompt_ids: list[int]) -> list[int] | None:
        """The chained hashes of the prompt's full pages; None when the prefix cache is off."""
        if self.pages.cache is None:
            return None
        return page_hashes(prompt_ids, self.pages.page_size)

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

    def live_rooms(self) -> set[str]:
        """Rooms of the requests the engine is working on now (a snapshot; PD holds not included)."""
        with self._rooms_lock:
            return set(self._live_rooms)

    def is_live(self, room: str) -> bool:
        """Whether `room` is a request the engine is still working on (or holds pages for)."""
        with self._rooms_lock:
            if room in self._live_rooms:
                return True
        return self.pages.has_room(room)

    # ---- caller-side plumbing -------------------------------------------------------------------
    def _claim_room(self, room: str) -> None:
        """Mark `room` live (until its request finishes); a room names one request at a time."""
        if self._thread is None:
            raise RuntimeError("engine not started")
        with self._rooms_lock:
            if room in self._live_rooms:
                raise ValueError(f"room {room!r} is already in use")
            self._live_rooms.add(room)

    def _release_room(self, room: str) -> None:
        with self._rooms_lock:
            self._live_rooms.discard(room)

    def _new_request(self, room: str, prompt_ids: list[int], params: SamplingParams) -> Request:
        request = Request(room=room, token_ids=list(prompt_ids), num_prompt=len(prompt_ids), params=params)
        if params.seed is not None:
            request.generator = torch.Generator(device=self.pool.device)
        request.stop_token_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(self.model_config.eos_token_ids))
        return request

    async def _stream(self, request: Request, command: _Command) -> AsyncIterator[list]:
        """Submit `command` for a request whose room is claimed; yield lists of what the engine
        emitted (everything queued at the time), with the text of each token made here, on the
        caller's loop, not on the engine thread."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        request.emit = lambda item: self._deliveries[loop].append((outputs.put_nowait, item))
        text = TextStream(self.tokenizer, request.params, prompt_ids=request.token_ids[:request.num_prompt],
                          eos_token_ids=self.model_config.eos_token_ids)
        self._inbox.put(command)
        done = False
        try:
            while not done:
                batch = []
                item = await outputs.get()
                while True:
                    if isinstance(item, TokenOutput) and item.token_id >= 0:
                        item, stopped_here = _with_text(item, text)
                        if stopped_here:  # a stop string: the engine does not know yet
                            self._inbox.put(_Finish(request.room))
                    batch.append(item)
                    done = _is_last(item)
                    if done or outputs.empty():
                        break
                    item = outputs.get_nowait()
                yield batch
        finally:
            if not done:
                if request.on_pages_filled is not None:
                    self._inbox.put(_Stop(request.room))
                else:
                    self.abort(request.room)

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
                self.scheduler.add(command.request)
            elif isinstance(command, _AddPrefilled):
                self.scheduler.add_running(command.request)
                first = command.first_token
                self._emit_token(command.request, first.logprob, first.top_logprobs)
            elif isinstance(command, _Abort):
                self._abort(command.room)
            elif isinstance(command, _Stop):
                self._stop(command.room)
            elif isinstance(command, _Finish):
                request = self.scheduler.requests.get(command.room)
                if request is not None:
                    self._finish(request, "stop")
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    @torch.inference_mode()
    def step(self) -> bool:
        """Schedule and run one forward pass, then sample and emit. False when there was nothing to do."""
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return False
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
            if request.prefill_only:
                self._finish_prefill(request, FirstToken(token_ids[row], logprob, top))
            else:
                request.token_ids.append(token_ids[row])
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
        request.emit(TokenOutput(token_id=token, text="", logprob=logprob, top_logprobs=top,
                                 finish_reason=reason, prompt_tokens=request.num_prompt,
                                 completion_tokens=request.num_generated))
        if reason is not None:
            self._finish(request, reason)

    def _finish(self, request: Request, reason: str) -> None:
        self.scheduler.finish(request, reason)
        self._release_room(request.room)

    def _finish_prefill(self, request: Request, first: FirstToken) -> None:
        self._call_pages_filled(request, request.page_ids[:self.pages.pages_for(request.num_prompt)],
                                request.num_prompt)
        if request.room not in self.scheduler.requests:  # the hook aborted it
            return
        result = PrefillResult(room=request.room, first_token=first, page_ids=list(request.page_ids),
                               prompt_tokens=request.num_prompt)
        self._finish(request, "stop")
        request.emit(result)

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
        if request is None:
            return
        self._release_room(room)
        if request.prefill_only:
            request.emit(None)  # ends the prefill's stream without a result
        else:
            request.emit(TokenOutput(token_id=-1, text="", logprob=None, top_logprobs=[],
                                     finish_reason="abort", prompt_tokens=request.num_prompt,
                                     completion_tokens=request.num_generated))

    def _stop(self, room: str) -> None:
        request = self.scheduler.requests.get(room)
        if request is None:
            return  # finished: a prefill's pages are held already, or it was aborted
        self.scheduler.finish(request, "abort", keep_pages=True)
        self._release_room(room)
        request.emit(None)

    def _deliver(self) -> None:
        deliveries, self._deliveries = self._deliveries, defaultdict(list)
        for loop, items in deliveries.items():
            try:
                loop.call_soon_threadsafe(_deliver_all, items)
            except RuntimeError:
                pass  # the caller's loop is closed: nobody is listening any more


def _in_short_lived_thread(function: Callable[[], T]) -> T:
    """Run `function` in a new thread, wait for it, return its result or raise its exception."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["value"] = function()
        except BaseException as exc:  # re-raised in the caller
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="pdserve-engine-load")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]


def _deliver_all(items: list[tuple[Callable, object]]) -> None:
    for put, item in items:
        put(item)


def _with_text(output: TokenOutput, text: TextStream) -> tuple[TokenOutput, bool]:
    """The output with its token's text; True when a stop string ends the output at this token
    although the engine did not end it (so the engine must be told)."""
    if text.finished:  # past a stop string: the caller has already returned
        return output, False
    delta, stopped = text.push(output.token_id)
    reason = "stop" if stopped else output.finish_reason
    if reason is not None and not stopped:
        delta += text.flush()
    return replace(output, text=delta, finish_reason=reason), stopped and output.finish_reason is None


def _is_last(item: object) -> bool:
    if isinstance(item, TokenOutput):
        return item.finish_reason is not None
    return True  # a PrefillResult, or None for an aborted prefill
