"""Scheduler: continuous batching with chunked prefill, a page budget and retraction.

Its unit is a `Request`: one sequence's tokens, KV pages and progress (the engine builds one from
each caller's EngineRequest; how a request samples and reaches its caller is the engine thread's,
engine/engine_thread.py RequestIO). Its output is a `SchedulerOutput`, the whole contract with the
model runner for one step. Each step (`schedule`) builds one SchedulerOutput:
1. every decode-ready running request contributes its last token; it first gets a page for it,
   and when none is free the newest running request is retracted (pages freed, back to the front
   of the waiting queue with prompt + generated tokens, recomputed later) until one is;
2. running requests with prefill work left (chunked prompts, resumed retractions) get chunks
   from a token budget of `chunked_prefill_size`, oldest first;
3. waiting requests are admitted, oldest first, while the budget, `max_running_requests` and free
   pages allow. Admission allocates pages for every known token at once, so a half-prefilled
   request never waits for memory.
Decodes and prefill chunks share the forward pass, so neither starves the other.

Prefix cache (when the PageManager has one): admission starts a request from the cached pages of
its longest cached run of leading full pages and computes only the rest. At least one token is
always computed (its logits give the next token), so a prompt cached to its end recomputes its
last page. Full pages enter the cache as soon as their K/V is computed (after each prefill
chunk), and when a request leaves (finished, aborted or retracted) with the pages it decoded.

Store tier (`store`, a libkv.store.StoreTier, with --enable-hierarchical-cache): pages entering
the cache are offered to it (written through in the background), and admission asks it for the
pages that follow the local match before computing them (fetched into fresh pages and cached).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from engine.page_manager import PageManager
from pdserve.page_hash import page_hashes, with_adapter

if TYPE_CHECKING:
    from engine.lora.slots import LoraSlots, SlotLoad
    from engine.multimodal.state import MultimodalState
    from libkv.store import StoreTier


class RequestStatus(Enum):
    WAITING = "waiting"  # not admitted (new, or retracted and waiting to be recomputed)
    RUNNING = "running"  # admitted: owns pages for all its known tokens
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """A sequence in the engine.

    `token_ids` is the prompt followed by the generated tokens; the first `num_computed` of them
    have their K/V in `page_ids`. A running request with num_computed == len(token_ids) - 1 is
    decode-ready (its last token is fed next step); fewer computed means prefill chunks remain
    (a new prompt, or a retracted request recomputing prompt + generated tokens).

    `prefill_only` requests (the prefill side of PD) stop after their first sampled token and
    keep their pages under their room until released. The engine builds one from the caller's
    EngineRequest (engine.request).
    """

    room: str
    token_ids: list[int]
    num_prompt: int
    prefill_only: bool = False
    status: RequestStatus = RequestStatus.WAITING
    page_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    admit_order: int = -1
    num_retractions: int = 0
    finish_reason: str | None = None
    # Prefix cache: hashes of the full pages of token_ids known so far (content only, so they
    # survive retraction), and how many of page_ids were offered to the cache.
    page_hashes: list[int] = field(default_factory=list)
    pages_cached: int = 0
    # Images: its M-RoPE positions, image embeddings, and the page salts that put each image's
    # digest into its pages' hashes.
    multimodal: MultimodalState | None = None
    # LoRA: the adapter's name (None: the base model) and, while running, its slot (engine.lora.slots).
    lora: str | None = None
    lora_slot: int = -1
    lora_held: bool = False
    lora_key: str | None = None  # the adapter's key in page hashes (LoraSlots.cache_key), set with the hold

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def decode_ready(self) -> bool:
        return self.num_computed == len(self.token_ids) - 1


@dataclass(frozen=True)
class ScheduledChunk:
    """New tokens of one sequence to run this step.

    `token_ids` start at position `start_pos` (the number of tokens whose K/V is already in the
    sequence's pages); `page_ids` are all of the sequence's pages in order and cover
    start_pos + len(token_ids) tokens. `sample` asks for the logits of the chunk's last token
    (true when the chunk reaches the end of the known tokens).

    A verify chunk (speculative decoding, engine.speculative) holds a request's last token followed
    by `num_drafts` drafted tokens: the runner returns logits for each of its last num_drafts + 1
    positions, and only its first token counts as computed until the drafts are verified.
    """

    room: str
    token_ids: list[int]
    start_pos: int
    page_ids: list[int]
    sample: bool
    multimodal: MultimodalState | None = None  # the request's, if it has images
    num_drafts: int = 0
    lora_slot: int = -1  # the request's LoRA slot; -1: the base model

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass
class SchedulerOutput:
    """One forward pass: decode tokens (one per sequence, prefix cached) and extend chunks.

    The runner returns logits for every decode, then for every extend with `sample` (num_drafts + 1
    rows for a verify chunk), in this order.
    """

    decodes: list[ScheduledChunk] = field(default_factory=list)
    extends: list[ScheduledChunk] = field(default_factory=list)
    # LoRA adapters copied into slots since the last step: tensor-parallel followers copy them too
    lora_loads: list[SlotLoad] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.extends

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(len(c.token_ids) for c in self.extends)

    def sampled_chunks(self) -> list[ScheduledChunk]:
        """The chunks whose logits the runner returns, in the order of its logits rows."""
        return self.decodes + [c for c in self.extends if c.sample]


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits, taken from EngineConfig (where their defaults live) by the engine;
    `max_seq_len` is the model's context length."""

    max_running_requests: int
    chunked_prefill_size: int
    max_seq_len: int


class Scheduler:
    """Owns the waiting queue and the running batch; the engine thread is its only caller."""

    def __init__(self, config: SchedulerConfig, pages: PageManager) -> None:
        if config.chunked_prefill_size <= 0 or config.max_running_requests <= 0:
            raise ValueError("chunked_prefill_size and max_running_requests must be positive")
        self.config = config
        self.pages = pages
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is the newest
        self.requests: dict[str, Request] = {}
        self.num_retractions = 0
        self._admissions = 0
        self.store: StoreTier | None = None  # --enable-hierarchical-cache: set by the engine
        self.lora: LoraSlots | None = None  # --enable-lora: set by the engine

    # ---- entry and exit -------------------------------------------------------------------------
    def check_fits(self, num_prompt: int, max_new_tokens: int) -> None:
        """Raise ValueError for a request that could never run with this context and page pool."""
        if num_prompt <= 0:
            raise ValueError("the prompt must contain at least one token")
        if num_prompt >= self.config.max_seq_len:
            raise ValueError(f"prompt of {num_prompt} tokens does not fit the context of "
                             f"{self.config.max_seq_len} tokens")
        capacity = self.pages.num_pages * self.pages.page_size
        longest = min(num_prompt + max_new_tokens, self.config.max_seq_len)
        if longest > capacity:
            raise ValueError(f"a request of up to {longest} tokens cannot fit the KV pool "
                             f"({self.pages.num_pages} pages of {self.pages.page_size} tokens)")

    def add(self, request: Request) -> None:
        """Queue a new request for admission."""
        self._register(request)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """Put a request whose prompt K/V is already in its pages straight into the running batch."""
        self._register(request)
        self._admit(request)

    def hold_lora(self, request: Request, running: bool) -> None:
        """A new request's adapter, held until it finishes (so it is not unloaded under it); a
        request put straight into the running batch (`running`) takes its slot now. ValueError
        for an adapter not loaded, or no free slot for a running one."""
        if request.lora is None:
            return
        if self.lora is None:
            raise ValueError(f"LoRA adapter {request.lora!r} asked of an engine without --enable-lora")
        self.lora.hold(request.lora)
        request.lora_held = True
        request.lora_key = self.lora.cache_key(request.lora)
        if running and not self._acquire_lora(request):
            self.unhold_lora(request)
            raise ValueError(f"no LoRA slot free for adapter {request.lora!r}: all {self.lora.num_slots} "
                             "hold running requests of other adapters")

    def unhold_lora(self, request: Request) -> None:
        """Undo `hold_lora` (a request leaving, or refused after it)."""
        self._release_lora_slot(request)
        if self.lora is not None and request.lora is not None and request.lora_held:
            self.lora.drop(request.lora)
        request.lora_held = False

    def _acquire_lora(self, request: Request) -> bool:
        if request.lora is None or self.lora is None or request.lora_slot >= 0:
            return True
        slot = self.lora.acquire(request.lora)
        if slot is None:
            return False
        request.lora_slot = slot
        return True

    def _release_lora_slot(self, request: Request) -> None:
        if self.lora is not None and request.lora_slot >= 0:
            self.lora.release(request.lora_slot)
        request.lora_slot = -1

    def _register(self, request: Request) -> None:
        if request.room in self.requests:
            raise ValueError(f"room {request.room!r} is already in use")
        self.requests[request.room] = request

    def _admit(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        request.admit_order = self._admissions
        self._admissions += 1
        self.running.append(request)

    def finish(self, request: Request, reason: str, keep_pages: bool = False) -> None:
        """Take a request out; a prefill-only request's pages are held under its room (aborted too
        with `keep_pages`), others freed."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.unhold_lora(request)
        self.requests.pop(request.room, None)
        self._cache_computed(request)
        if request.prefill_only and (reason != "abort" or keep_pages):
            self.pages.hold(request.room, request.page_ids)
        else:
            self.pages.free(request.page_ids)

    def abort(self, room: str) -> Request | None:
        """Finish a live request with "abort" (its pages freed); None if `room` is not live."""
        request = self.requests.get(room)
        if request is None:
            return None
        self.finish(request, "abort")
        return request

    def retract(self, request: Request) -> None:
        """Free a running request's pages and queue it (first in line) to be recomputed."""
        self.running.remove(request)
        self._cache_computed(request)
        self.pages.free(request.page_ids)
        self._release_lora_slot(request)
        request.pages_cached = 0
        request.num_computed = 0
        request.status = RequestStatus.WAITING
        request.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(request)

    @property
    def num_retracted_waiting(self) -> int:
        # list() copies atomically under the GIL: stats() calls this from other threads.
        return sum(1 for r in list(self.waiting) if r.num_retractions)

    # ---- one step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        batch = SchedulerOutput()
        self._schedule_decodes(batch)
        budget = self.config.chunked_prefill_size
        for request in self.running:
            if budget <= 0:
                break
            if request.num_computed < request.num_tokens - 1:
                budget -= self._add_chunk(batch, request, budget)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
            request = self.waiting[0]
            if not self._acquire_lora(request):
                break  # every LoRA slot holds running requests of other adapters
            if not self._allocate(request):
                self._release_lora_slot(request)
                break
            self.waiting.popleft()
            self._admit(request)
            budget -= self._add_chunk(batch, request, budget)
        if self.lora is not None:
            batch.lora_loads = self.lora.take_loads()
        return batch

    def _allocate(self, request: Request) -> bool:
        """Pages for every known token of a waiting request, its leading pages from the prefix
        cache; False (and nothing held) if they do not fit. Keeps one page of slack per running
        request so admitting this one does not force a retraction at the next page boundary."""
        size = self.pages.page_size
        cached: list[int] = []
        if self.pages.cache is not None:
            request.page_hashes = page_hashes(request.token_ids, size, request.page_hashes, _salts(request))
            max_pages = (request.num_tokens - 1) // size
            cached = self.pages.acquire_prefix(request.token_ids, max_pages, request.page_hashes)
            if self.store is not None and len(cached) < max_pages:
                cached += self._fetch_from_store(self.store, request, cached, max_pages)
        num_cached = len(cached)
        request.page_ids = cached  # grown in place below
        if not self.pages.grow(request.page_ids, request.num_tokens, keep_free=len(self.running)):
            self.pages.free(request.page_ids)
            return False
        request.num_computed = num_cached * size
        request.pages_cached = num_cached
        self.pages.count_query(request.num_tokens, request.num_computed)
        return True

    def _fetch_from_store(self, store: StoreTier, request: Request, cached: list[int],
                          max_pages: int) -> list[int]:
        """Pages after `cached` that the store holds, fetched into fresh pages and cached here."""
        size = self.pages.page_size

        def allocate(n: int) -> list[int] | None:
            pages: list[int] = []
            return pages if self.pages.grow(pages, n * size, keep_free=len(self.running)) else None

        fetched = store.fetch(request.token_ids, request.page_hashes, len(cached), max_pages, allocate)
        if fetched:
            pages = cached + fetched
            self.pages.cache_pages(request.token_ids, pages, request.page_hashes[:len(pages)], len(cached))
        return fetched

    def _cache_computed(self, request: Request) -> None:
        """Offer the request's full pages whose K/V is computed to the prefix cache."""
        if self.pages.cache is None or not request.page_ids:
            return
        full = min(request.num_computed // self.pages.page_size, len(request.page_ids))
        if full <= request.pages_cached:
            return
        if len(request.page_hashes) < full:
            request.page_hashes = page_hashes(request.token_ids[:full * self.pages.page_size],
                                              self.pages.page_size, request.page_hashes, _salts(request))
        self.pages.cache_pages(request.token_ids, request.page_ids, request.page_hashes[:full],
                               request.pages_cached)
        if self.store is not None:
            self.store.offer(request.token_ids, request.page_ids, request.page_hashes[:full],
                             request.pages_cached)
        request.pages_cached = full

    def _schedule_decodes(self, batch: SchedulerOutput) -> None:
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING or not request.decode_ready:
                continue
            while not self.pages.grow(request.page_ids, request.num_tokens):
                victim = self._retraction_victim(request)
                self.retract(victim)
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                batch.decodes.append(ScheduledChunk(
                    room=request.room, token_ids=request.token_ids[-1:], start_pos=request.num_computed,
                    page_ids=request.page_ids, sample=True, multimodal=request.multimodal,
                    lora_slot=request.lora_slot))

    def _retraction_victim(self, needy: Request) -> Request:
        # The newest request loses least work. Requests iterate oldest first, so the victim is
        # never one whose decode is already in this batch. Prefill-only requests are not retracted
        # (their filled pages may already be on their way to a decode worker).
        for request in reversed(self.running):
            if not request.prefill_only:
                return request
        return needy

    def _add_chunk(self, batch: SchedulerOutput, request: Request, budget: int) -> int:
        end = min(request.num_tokens, request.num_computed + budget)
        batch.extends.append(ScheduledChunk(
            room=request.room, token_ids=request.token_ids[request.num_computed:end],
            start_pos=request.num_computed, page_ids=request.page_ids, sample=end == request.num_tokens,
            multimodal=request.multimodal, lora_slot=request.lora_slot))
        return end - request.num_computed

    def advance(self, batch: SchedulerOutput) -> None:
        """Record that the batch's K/V is now in the pages (called after the forward pass)."""
        for chunk in batch.decodes:
            self.requests[chunk.room].num_computed = chunk.end_pos
        for chunk in batch.extends:
            request = self.requests[chunk.room]
            request.num_computed = chunk.end_pos - chunk.num_drafts  # drafts count once verified
            self._cache_computed(request)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)


def _salts(request: Request) -> list[int]:
    """The request's per-page hash salts: its images' digests and its LoRA adapter
    (pdserve.page_hash.page_hash)."""
    salts = request.multimodal.page_salts if request.multimodal is not None else []
    return with_adapter(salts, request.lora_key) if request.lora_key is not None else salts
