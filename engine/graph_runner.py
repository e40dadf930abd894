"""Decode steps at a few fixed batch sizes over static input buffers: CUDA graphs on a GPU, the same
padding replayed eagerly on CPU.

A decode-only step's launch cost on a GPU is one kernel launch per op per layer, the same at batch 1
as at 64; a CUDA graph replays them all with one launch. A graph is captured once per batch size
over tensors that then stay put, so the step's inputs live in static buffers written in place
(`DecodeGraphRunner.run`): token ids, positions, KV slots, a page table of fixed width (every
sequence may grow to the model's context) and sequence lengths. A batch of n sequences runs as the
graph of the next captured size up; its padded rows decode token 0 at position 0 over one token of
a scratch page that no request ever owns, so they never write a real KV page, and their logits are
dropped. Nothing in the step reads a value back to the host (no .item(), no shape that depends on
the data): the rotary tables are sized for the whole context once, and the attention kernels mask
by the sequence lengths they read on the device.

On CPU there are no graphs: the same buffers and padding run the model eagerly, so the padding is
proved on every machine (tests/engine/test_graph_runner.py: a padded batch's tokens equal the
unpadded ones bit for bit, which holds because every op computes a row from that row alone: see
engine.models.attention). Steps with prompt chunks never come here; the model runner runs them
eagerly.
"""

from __future__ import annotations

import bisect
import logging
from collections import Counter
from dataclasses import dataclass

import torch

from engine.models.attention import AttentionMetadata
from engine.models.decoder import DecoderModel
from engine.scheduler import SchedulerOutput
from libkv.pool import KVPool

log = logging.getLogger(__name__)

# SGLang's default list starts the same way: small batches are the common case and each extra
# size costs one capture (memory for its activations, seconds at start-up).
_SMALL_SIZES = (1, 2, 4, 8)
_SIZE_STEP = 8


def capture_sizes(max_bs: int | None, sizes: tuple[int, ...], max_running_requests: int) -> tuple[int, ...]:
    """The decode batch sizes to capture, ascending: `sizes` if given (--cuda-graph-bs), else 1, 2,
    4, 8 and every multiple of 8 up to `max_bs` (--cuda-graph-max-bs; default the running batch's
    limit), with `max_bs` itself last. Sizes above the running batch's limit are never used and
    are dropped. ValueError for a size below 1."""
    if any(size < 1 for size in sizes) or (max_bs is not None and max_bs < 1):
        raise ValueError(f"CUDA graph batch sizes must be at least 1, got {sizes or max_bs}")
    if sizes:
        chosen = sorted({size for size in sizes if size <= max_running_requests})
        return tuple(chosen) or (min(sizes),)
    top = min(max_bs or max_running_requests, max_running_requests)
    ladder = {size for size in _SMALL_SIZES if size <= top}
    ladder.update(range(_SIZE_STEP * 2, top + 1, _SIZE_STEP))
    ladder.add(top)
    return tuple(sorted(ladder))


@dataclass(frozen=True)
class GraphPlan:
    """Whether an engine runs decode steps through a DecodeGraphRunner, and why not when it does
    not (said once at load)."""

    sizes: tuple[int, ...]  # empty: every step eager
    capture: bool  # CUDA graphs (False: the CPU's eager replay of the same padding)
    reason: str  # why graphs are off, or how they run


def plan_graphs(*, device: torch.device, disabled: bool, max_bs: int | None, sizes: tuple[int, ...],
                max_running_requests: int, world_size: int, multimodal: bool,
                routed_or_latent: bool, lora: bool = False) -> GraphPlan:
    """Decide from the engine's flags and model. On CUDA graphs are on unless --disable-cuda-graph;
    on CPU the eager replay runs only when asked for (--cuda-graph-max-bs or --cuda-graph-bs): it
    saves nothing there, it exists to prove the GPU path's padding on machines without one."""
    off = GraphPlan((), False, "")
    if disabled:
        return GraphPlan((), False, "--disable-cuda-graph")
    if device.type != "cuda" and max_bs is None and not sizes:
        return GraphPlan((), False, "eager on CPU (the padded replay runs with --cuda-graph-max-bs or "
                                    "--cuda-graph-bs)")
    if world_size > 1:
        return GraphPlan((), False, "several ranks (graphs run on one rank so far)")
    if multimodal:
        return GraphPlan((), False, "a vision-language model (its steps carry per-request positions)")
    if lora:
        return GraphPlan((), False, "LoRA adapters (their per-row slots are not in the static buffers yet)")
    if device.type == "cuda" and routed_or_latent:
        # Their torch paths read expert counts and sequence lengths back to the host each layer.
        return GraphPlan((), False, "MoE and MLA layers are not graph-capturable yet")
    chosen = capture_sizes(max_bs, sizes, max_running_requests)
    capture = device.type == "cuda"
    how = "CUDA graphs" if capture else "eager replay of the padded static buffers"
    return GraphPlan(chosen, capture, f"{how} at batch sizes {list(chosen)}") if chosen else off


@dataclass
class _PageRow:
    """A decoding request's row of DecodeGraphRunner.table_rows: which row, the page list it
    mirrors, and how many of its pages are written there."""

    index: int
    pages: list[int]
    written: int = 0


class DecodeGraphRunner:
    """Runs decode-only steps of up to `sizes[-1]` sequences (see the module docstring).

    The model runner asks `takes(batch)` and, if so, calls `run(batch)` in place of its eager
    step, on the engine thread (one step at a time: the buffers are shared by every step).
    `scratch_page` is a page of `pool` the page manager never hands out.
    """

    def __init__(self, model: DecoderModel, pool: KVPool, sizes: tuple[int, ...], max_seq_len: int,
                 scratch_page: int, capture: bool) -> None:
        if not sizes:
            raise ValueError("a DecodeGraphRunner needs at least one batch size")
        self.model = model
        self.pool = pool
        self.sizes = sizes
        self.capture = capture
        self.max_bs = sizes[-1]
        self.page_size = pool.layout.page_size
        self.scratch_page = scratch_page
        self.scratch_slot = scratch_page * self.page_size
        # Every position the model may see: the rotary tables grow once to cover it (a graph
        # keeps the tables it was captured with).
        self.max_position = max_seq_len - 1
        self.width = -(-max_seq_len // self.page_size)
        device = pool.device
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.long, device=device)
        self.slots = torch.full((self.max_bs,), self.scratch_slot, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(self.max_bs, dtype=torch.int32, device=device)
        # The page tables live in rows that stay a request's while it decodes (`_PageRow`): a step
        # writes only the pages added since the last one (one per page_size steps), not every page
        # of every sequence (64 rows of 129 pages built from lists took milliseconds per step), and
        # gathers its batch's rows by index. The last row is the padding's: the scratch page.
        self.table_rows = torch.full((self.max_bs + 1, self.width), scratch_page, dtype=torch.int32,
                                     device=device)
        self.padding_row = self.max_bs
        self.row_of_batch = torch.full((self.max_bs,), self.padding_row, dtype=torch.long, device=device)
        self._rows: dict[str, _PageRow] = {}
        self._free_rows = list(range(self.max_bs))
        # One host-to-device copy per step of the five per-row values (pinned on CUDA so the copy is
        # asynchronous; a batch's rows are one contiguous block of it): token id, position, slot,
        # sequence length, table row.
        self._staging = torch.zeros((self.max_bs, 5), dtype=torch.long, pin_memory=device.type == "cuda")
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._graph_pool = None  # one memory pool for every captured graph (set at the first capture)
        self.last_replayed = False  # the last step ran a captured CUDA graph (the log line's flag)
        self.steps_by_size: Counter[tuple[int, int]] = Counter()  # (rows, padded size) -> steps run

    def takes(self, batch: SchedulerOutput) -> bool:
        """A decode-only step of at most max_bs sequences, none with images."""
        return (not batch.extends and 0 < len(batch.decodes) <= self.max_bs
                and all(chunk.multimodal is None for chunk in batch.decodes))

    def forget_rows(self) -> None:
        """Let go of every request's table row: the model runner calls it for each step it runs
        eagerly, in which a request may have been retracted and re-admitted with other pages (a
        decode-only step follows only decode-only steps or one of those)."""
        self._rows.clear()
        self._free_rows = list(range(self.max_bs))

    def padded_size(self, num_rows: int) -> int:
        """The smallest captured size holding `num_rows`."""
        return self.sizes[bisect.bisect_left(self.sizes, num_rows)]

    def run(self, batch: SchedulerOutput) -> torch.Tensor:
        """fp32 logits [len(batch.decodes), vocab] of a step `takes` accepted."""
        rows = len(batch.decodes)
        size = self.padded_size(rows)
        self.steps_by_size[rows, size] += 1
        if self.capture and size not in self._graphs:
            self._capture(size)
        self._fill(batch, size)
        if not self.capture:
            self.last_replayed = False
            return self._forward(size)[:rows]
        graph, logits = self._graphs[size]
        graph.replay()
        self.last_replayed = True
        return logits[:rows]

    def _fill(self, batch: SchedulerOutput, size: int) -> None:
        """Write the step's inputs into rows [0, size) of the static buffers; rows past the batch
        get the padding (token 0 at position 0, one token of the scratch page)."""
        staging = self._staging
        rows = len(batch.decodes)
        staging[rows:size] = torch.tensor([0, 0, self.scratch_slot, 1, self.padding_row])
        if rows:
            page = self.page_size
            values = [[c.token_ids[0] for c in batch.decodes], [c.start_pos for c in batch.decodes],
                      [c.page_ids[c.start_pos // page] * page + c.start_pos % page for c in batch.decodes],
                      [c.end_pos for c in batch.decodes], self._table_rows(batch)]
            staging[:rows] = torch.tensor(values, dtype=torch.long).T
        device_rows = staging[:size].to(self.input_ids.device, non_blocking=True)
        self.input_ids[:size].copy_(device_rows[:, 0])
        self.positions[:size].copy_(device_rows[:, 1])
        self.slots[:size].copy_(device_rows[:, 2])
        self.seq_lens[:size].copy_(device_rows[:, 3])
        self.row_of_batch[:size].copy_(device_rows[:, 4])

    def _table_rows(self, batch: SchedulerOutput) -> list[int]:
        """Each decode's table row, its new pages written: a request keeps its row from step to
        step; a row whose request left the batch (finished, retracted) is free again. A request
        is recognized by its room and its very page list (the scheduler's, grown in place); a
        list that shrank was given back and refilled, so its row is written whole."""
        rooms = {chunk.room for chunk in batch.decodes}
        for room in [room for room in self._rows if room not in rooms]:
            self._free_rows.append(self._rows.pop(room).index)
        indices = []
        for chunk in batch.decodes:
            row = self._rows.get(chunk.room)
            if row is None:
                row = self._rows[chunk.room] = _PageRow(self._free_rows.pop(), chunk.page_ids)
            elif row.pages is not chunk.page_ids or len(chunk.page_ids) < row.written:
                row.pages, row.written = chunk.page_ids, 0
            count = len(chunk.page_ids)
            if count > row.written:
                new = torch.tensor(chunk.page_ids[row.written:count], dtype=torch.int32)
                self.table_rows[row.index, row.written:count].copy_(new)
                row.written = count
            indices.append(row.index)
        return indices

    def _forward(self, size: int) -> torch.Tensor:
        # Inside the graph: the rows are gathered from where the tables live, by the batch's index.
        page_table = self.table_rows.index_select(0, self.row_of_batch[:size])
        meta = AttentionMetadata(slots=self.slots[:size], num_decode=size, decode_page_table=page_table,
                                 decode_seq_lens=self.seq_lens[:size], extends=[])
        logits = self.model.forward(self.input_ids[:size], self.positions[:size], self.max_position, meta,
                                    self.pool.buffer, None)
        if logits is None:
            raise RuntimeError("a single-rank model returned no logits")
        return logits

    def _capture(self, size: int) -> None:
        """Capture the graph of `size` rows, all of them padding while it is captured (the warm-up
        runs execute, and must write only the scratch page). Graphs share one memory pool: they
        never run at the same time."""
        self.input_ids[:size] = 0
        self.positions[:size] = 0
        self.slots[:size] = self.scratch_slot
        self.seq_lens[:size] = 1
        self.row_of_batch[:size] = self.padding_row
        device = self.pool.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            # Compiles the Triton kernels, grows the rotary tables, picks cuBLAS's algorithms:
            # none of which may happen inside a capture.
            for _ in range(2):
                self._forward(size)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()  # type: ignore[assignment]
        with torch.cuda.graph(graph, pool=self._graph_pool):
            logits = self._forward(size)
        self._graphs[size] = (graph, logits)
        log.info("captured the decode CUDA graph of batch size %d", size)
