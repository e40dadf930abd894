"""EngineThread: the engine's one forward loop, over the scheduler, the model runner and the sampler.

Threading protocol. The loop runs in ONE background thread (`start`); torch releases the GIL
during the heavy ops, so an asyncio server keeps serving while it runs. Callers on any asyncio
loop post commands (`post`: add, abort, stop, finish, wake) to a thread-safe inbox; the thread
applies them only between steps, so a request is never freed while a forward pass uses its pages.
Outputs go back through each request's `emit`, gathered per caller loop and handed over with
`loop.call_soon_threadsafe` once per step: one wake-up of each caller loop per step, however many
requests it streams.

Per live request the thread keeps the scheduler's record (engine.scheduler.Request: tokens, pages,
progress) and its own `RequestIO` beside it: how it samples (params, seeded generator, stop token
ids) and how it reaches its caller (emit, the prefill's pages-filled hook).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.constraints import LogitsConstraints
from engine.grammar import RequestGrammar
from engine.outputs import FirstToken, TokenOutput
from engine.page_manager import PageManager
from engine.profiling import StepProfiler
from engine.request import PagesFilled
from engine.sampling import SampleResult, SamplingParams, sample, sampling_probs
from engine.scheduler import Request, RequestStatus, ScheduledChunk, Scheduler, SchedulerOutput
from engine.speculative.speculator import DraftPolicy, Speculator
from engine.step_clock import StepClock

log = logging.getLogger("engine.engine")

Emit = Callable[[TokenOutput | Exception], None]  # delivers an output (or a refusal) to the caller


@dataclass(eq=False)
class RequestIO:
    """What the engine thread keeps of a live request beside the scheduler's record."""

    emit: Emit
    params: SamplingParams
    stop_token_ids: frozenset[int]  # sampling one ends the request ("stop"); eos included
    generator: torch.Generator | None = None  # a seeded request's, reseeded per token (step_seed)
    on_pages_filled: PagesFilled | None = None  # a prefill-only request's progress hook
    pages_reported: int = 0  # pages handed to on_pages_filled so far
    grammar: RequestGrammar | None = None  # a structured output's state (engine.grammar)
    carried_tokens: int = 0  # EngineRequest.carried_tokens


# ---- inbox commands (caller thread -> engine thread) ------------------------------------------


@dataclass(frozen=True)
class Add:
    """A new request; `first_token` set: its prompt's K/V is in the pages reserved under the room."""

    request: Request
    io: RequestIO
    first_token: FirstToken | None = None


@dataclass(frozen=True)
class Abort:
    """Finish the request with "abort" and free its pages (a finished prefill's held ones too)."""

    room: str


@dataclass(frozen=True)
class Stop:
    """The caller of a prefill with a transfer hook stopped listening: stop the request but keep
    its pages held under the room, since transfers may still be reading them (engine.request)."""

    room: str


@dataclass(frozen=True)
class Finish:
    """The caller found a stop string: finish the request without emitting anything more."""

    room: str


@dataclass(frozen=True)
class Wake:
    """Pages were released elsewhere: waiting requests may fit now."""


Command = Add | Abort | Stop | Finish | Wake


def step_seed(seed: int, index: int) -> int:
    """Seed of the generator that samples a request's `index`-th token.

    Seeding by (request seed, token index) instead of keeping one generator running makes a
    seeded request's tokens independent of how it was run: retracted and recomputed, or
    prefilled on one worker and decoded on another, it samples the same tokens.
    """
    return (seed * 0x9E3779B1 + index * 0x85EBCA77 + 1) % (2**63 - 1)


class EngineThread:
    """The forward loop (see the module docstring). `step` may also be driven by hand, with the
    thread not started (a benchmark that times steps)."""

    def __init__(self, scheduler: Scheduler, runner: Callable[[SchedulerOutput], torch.Tensor],
                 pages: PageManager, device: torch.device, profiler: StepProfiler,
                 num_threads: int | None, speculator: Speculator | None = None) -> None:
        self.scheduler = scheduler
        self.speculator = speculator  # speculative decoding's drafts and their verification
        self.forward = runner
        self.pages = pages
        self.device = device
        self.profiler = profiler
        self.num_threads = num_threads
        self.step_clock = StepClock()
        self.constraints = LogitsConstraints(device)
        self.generated_tokens = 0
        self.steps = 0
        self.inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._io: dict[str, RequestIO] = {}
        self._deliveries: dict[asyncio.AbstractEventLoop, list[tuple[Emit, TokenOutput | Exception]]] = \
            defaultdict(list)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # ---- lifecycle ------------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("engine already started")
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop after the current step, apply what is left in the inbox, abort every live request."""
        self._stopping.set()
        self.inbox.put(Wake())
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.constraints.close()
        self._apply_inbox(block=False)
        self._abort_all()
        self.deliver()

    def post(self, command: Command) -> None:
        """Hand a command to the thread (any thread may call it)."""
        self.inbox.put(command)

    def emitter(self, loop: asyncio.AbstractEventLoop,
                put: Callable[[TokenOutput | Exception], None]) -> Emit:
        """The `emit` of a request whose caller receives its outputs with `put` on `loop`."""
        return lambda item: self._deliveries[loop].append((put, item))

    # ---- the loop -------------------------------------------------------------------------------
    def _run(self) -> None:
        if self.num_threads:
            torch.set_num_threads(self.num_threads)  # the intra-op pool size is per thread
        busy = False
        while not self._stopping.is_set():
            # Block for commands when idle, or when the last step found nothing it could run
            # (e.g. waiting requests need pages that PD holds): `release` posts a wake-up.
            self._apply_inbox(block=not busy or not self.scheduler.has_work())
            self.deliver()  # e.g. the first token of a request that joined prefilled
            try:
                busy = self.step()
            except Exception:
                log.exception("engine step failed; aborting every live request")
                self._abort_all()
                busy = False
            self.deliver()

    def _apply_inbox(self, block: bool) -> None:
        try:
            command = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(command, Add):
                self.add(command.request, command.io, command.first_token)
            elif isinstance(command, Abort):
                self._abort(command.room)
            elif isinstance(command, Stop):
                self._stop(command.room)
            elif isinstance(command, Finish):
                request = self.scheduler.requests.get(command.room)
                if request is not None:
                    self._end(request, "stop")
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                return

    def add(self, request: Request, io: RequestIO, first_token: FirstToken | None = None) -> None:
        """Take a new request, or refuse it through its `emit`. A room names one request at a time:
        one the scheduler has, or one with pages reserved or held under it, is in use, except by
        the prefilled request those reserved pages are for, which takes them over (or, refused,
        frees them: nobody else would). On the engine thread (or with the thread not started)."""
        room = request.room
        try:
            if room in self.scheduler.requests or (first_token is None and self.pages.has_room(room)):
                raise ValueError(f"room {room!r} is already in use")
            self.scheduler.hold_lora(request, running=first_token is not None)
            if first_token is not None:
                request.page_ids = self._take_reservation(request)
        except (KeyError, ValueError) as refused:
            self.scheduler.unhold_lora(request)
            if first_token is not None:
                self.pages.release(room)
            io.emit(refused)  # the caller's stream raises it
            return
        self._io[room] = io
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
        num_decodes = len(batch.decodes)
        if self.speculator is not None:
            self.speculator.propose(batch, self._draft_policy)
        if self.profiler.active:  # off after its bounded steps: this check is all it costs then
            ran = self.profiler.run(batch, self._run_step)
        else:
            ran = self._run_step(batch)
        self.step_clock.record(kind, time.perf_counter() - began, num_decodes)
        return ran

    def _run_step(self, batch: SchedulerOutput) -> bool:
        """Forward, sample and emit one scheduled batch (inside `step`'s inference mode)."""
        logits = self.forward(batch)
        if self.speculator is not None:
            self.speculator.observe(batch)
        self.scheduler.advance(batch)
        self.steps += 1
        self._report_filled_pages(batch)
        chunks = batch.sampled_chunks()
        if not chunks:
            return True
        requests = [self.scheduler.requests[c.room] for c in chunks]
        ios = [self._io[r.room] for r in requests]
        for request, io in zip(requests, ios, strict=True):
            if io.generator is not None and io.params.seed is not None:
                io.generator.manual_seed(step_seed(io.params.seed, request.num_generated))
        rows = [c.num_drafts + 1 for c in chunks]  # a verify chunk has a row per position
        # Verify rows belong to requests without penalties or a grammar (_draft_policy), which the
        # constraints pass over; a constrained request has its one row.
        row_requests = [r for r, n in zip(requests, rows, strict=True) for _ in range(n)]
        row_ios = [io for io, n in zip(ios, rows, strict=True) for _ in range(n)]
        logits = self.constraints.apply(logits, row_requests, row_ios)
        result = sample(logits, [io.params for io in row_ios], [io.generator for io in row_ios])
        token_ids = result.token_ids.tolist()
        self.constraints.accept(row_ios, result.token_ids, token_ids)
        row = 0
        for chunk, request, io in zip(chunks, requests, ios, strict=True):
            row += chunk.num_drafts + 1
            if chunk.num_drafts:
                self._emit_verified(chunk, request, result, logits, row - chunk.num_drafts - 1)
                continue
            logprob, top = result.logprobs_of(row - 1, io.params)
            request.token_ids.append(token_ids[row - 1])
            if request.prefill_only:
                self._finish_prefill(request, logprob, top)
            else:
                self._emit_token(request, logprob, top)
        return True

    def _emit_verified(self, chunk: ScheduledChunk, request: Request, result: SampleResult,
                       logits: torch.Tensor, first_row: int) -> None:
        """Emit what a verify chunk yields (engine.speculative.speculator): its accepted drafts and
        the target's token after them, until one of them ends the request."""
        assert self.speculator is not None
        io = self._io[request.room]
        params = io.params
        rows = range(first_row, first_row + chunk.num_drafts + 1)
        if params.greedy:
            tokens = self.speculator.accept(chunk, result.token_ids[first_row:rows.stop].tolist())
        else:
            probs = sampling_probs(logits[first_row:rows.stop].float(), [params] * len(rows))
            tokens = self.speculator.accept_sampled(chunk, probs, io.generator)
        for offset, token in enumerate(tokens):
            logprob, top = result.logprobs_of(first_row + offset, params)
            request.token_ids.append(token)
            self._emit_token(request, logprob, top)
            if request.status is RequestStatus.FINISHED:
                return
        self.speculator.settle(request)

    def _draft_policy(self, request: Request) -> DraftPolicy:
        """Drafts a request may verify this step: no more than it has tokens left to generate after
        the target's own; a sampled one only where the drafter gives its drafts' distribution
        (rejection sampling), and without logprobs (a replaced draft's would not be the emitted one's)."""
        assert self.speculator is not None
        params = self._io[request.room].params
        if request.prefill_only:
            # Its last prompt token runs as a decode when a chunk stopped one short of the end; the
            # prefill side of PD gives exactly the one token after the prompt, never a verify's run.
            return DraftPolicy(0, params)
        left = min(params.max_new_tokens - request.num_generated,
                   self.scheduler.config.max_seq_len - request.num_tokens)
        if not params.greedy and (not self.speculator.samples or params.logprobs):
            return DraftPolicy(0, params)
        if params.penalized or self._io[request.room].grammar is not None:
            # Penalties and a grammar's mask at a position depend on the tokens before it, which a
            # verify's rows would not see: such a request decodes a token a step.
            return DraftPolicy(0, params)
        generator = None
        if params.seed is not None and not params.greedy:  # its own stream, apart from the verify's
            generator = torch.Generator(device=self.device).manual_seed(
                step_seed(params.seed ^ 0x5DEECE66D, request.num_generated))
        return DraftPolicy(left - 1, params, generator)

    def _emit_token(self, request: Request, logprob: float | None, top: list[tuple[int, float]]) -> None:
        """Emit the request's newest token (text is added by the caller's stream) and finish the
        request if a token-level condition ends it here: a stop token or eos ("stop"), or length."""
        io = self._io[request.room]
        token = request.token_ids[-1]
        self.generated_tokens += 1
        reason = None
        if token in io.stop_token_ids:
            reason = "stop"
        elif request.num_generated >= io.params.max_new_tokens or \
                request.num_tokens >= self.scheduler.config.max_seq_len:
            reason = "length"
        io.emit(_output(request, token, logprob, top, reason))
        if reason is not None:
            self._end(request, reason)

    def _finish_prefill(self, request: Request, logprob: float | None, top: list[tuple[int, float]]) -> None:
        """A prefill-only request sampled its first token: report all its pages, hold them under the
        room and emit the token as its one output."""
        if self.speculator is not None:  # NEXTN's MTP K/V of the last position, before the pages go
            self.speculator.prefilled(request)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # written before a transfer reads
        self._call_pages_filled(request, request.page_ids[:self.pages.pages_for(request.num_prompt)],
                                request.num_prompt)
        if request.room not in self.scheduler.requests:  # the hook failed: stopped, with an abort output
            return
        io = self._end(request, "stop")
        io.emit(_output(request, request.token_ids[-1], logprob, top, "stop"))

    def _report_filled_pages(self, batch: SchedulerOutput) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # K/V written before a transfer reads
        for chunk in batch.extends:
            request = self.scheduler.requests.get(chunk.room)
            if request is None or not request.prefill_only or chunk.sample:
                continue  # the final chunk reports in _finish_prefill, with its partial page
            full = request.num_computed // self.pages.page_size
            if full > self._io[request.room].pages_reported:
                self._call_pages_filled(request, request.page_ids[:full], request.num_computed)

    def _call_pages_filled(self, request: Request, page_ids: list[int], num_tokens: int) -> None:
        io = self._io[request.room]
        io.pages_reported = len(page_ids)
        if io.on_pages_filled is None:
            return
        try:
            io.on_pages_filled(list(page_ids), num_tokens)
        except Exception:
            log.exception("room %s: on_pages_filled failed; stopping the prefill", request.room)
            self._stop(request.room)  # earlier writes may still read the pages: the caller frees them

    def _end(self, request: Request, reason: str, keep_pages: bool = False) -> RequestIO:
        """Take a request out of the scheduler (engine.scheduler.Scheduler.finish); its IO, which
        the thread forgets."""
        self.scheduler.finish(request, reason, keep_pages=keep_pages)
        if self.speculator is not None:
            self.speculator.forget(request.room)
        self.constraints.release(request.room)
        return self._io.pop(request.room)

    def _abort(self, room: str) -> None:
        request = self.scheduler.requests.get(room)
        if request is not None:
            io = self._end(request, "abort")
        self.pages.release(room)  # a finished prefill's held pages, or an unused reservation
        if request is not None:
            io.emit(_output(request, -1, None, [], "abort"))

    def _abort_all(self) -> None:
        for room in list(self.scheduler.requests):
            self._abort(room)

    def _stop(self, room: str) -> None:
        request = self.scheduler.requests.get(room)
        if request is None:
            return  # finished: a prefill's pages are held already, or it was aborted
        io = self._end(request, "abort", keep_pages=True)
        io.emit(_output(request, -1, None, [], "abort"))

    def deliver(self) -> None:
        """Hand every output emitted since the last call to its caller's loop."""
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


def _deliver_all(items: list[tuple[Emit, TokenOutput | Exception]]) -> None:
    for put, item in items:
        put(item)
