"""The decode graph runner's padding (engine.graph_runner), proved on CPU: a batch padded to the next
captured size gives the unpadded batch's tokens and logprobs bit for bit, and its padded rows write
only the scratch page. On CPU the runner replays the padded static buffers eagerly (no graphs); the
same buffers and padding are what a GPU captures."""

from __future__ import annotations

import argparse
import asyncio

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.graph_runner import capture_sizes, plan_graphs
from engine.request import EngineRequest
from engine.sampling import SamplingParams
from pdserve.config_flags import add_config_arguments, config_from_args
from tests.engine.conftest import generate, random_prompts, start_engine
from tools.models.tiny_model import write_tiny_model

SIZES = (1, 2, 4, 8)


def test_capture_sizes_default_to_sglangs_ladder():
    assert capture_sizes(None, (), 64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert capture_sizes(20, (), 64) == (1, 2, 4, 8, 16, 20)
    assert capture_sizes(100, (), 6) == (1, 2, 4, 6)  # never above the running batch's limit
    assert capture_sizes(None, (8, 3, 3, 100), 64) == (3, 8)
    with pytest.raises(ValueError, match="at least 1"):
        capture_sizes(None, (0, 4), 64)


def test_plan_graphs():
    def plan(device="cuda", **kw):
        args = dict(disabled=False, max_bs=None, sizes=(), max_running_requests=16, world_size=1,
                    multimodal=False, routed_or_latent=False)
        return plan_graphs(device=torch.device(device), **{**args, **kw})

    assert plan().sizes == (1, 2, 4, 8, 16) and plan().capture
    assert plan(disabled=True).sizes == ()
    assert plan(routed_or_latent=True).sizes == ()  # not capturable on CUDA yet
    assert plan("cpu").sizes == ()  # the CPU replay is asked for, never on by default
    cpu = plan("cpu", max_bs=4, routed_or_latent=True)
    assert cpu.sizes == (1, 2, 4) and not cpu.capture
    assert plan("cpu", sizes=(2,), world_size=2).sizes == ()
    assert plan("cpu", sizes=(2,), multimodal=True).sizes == ()


def test_flags_take_sglangs_spelling():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, EngineConfig)
    args = parser.parse_args(["--model-path", "m", "--cuda-graph-bs", "1", "2", "8",
                              "--cuda-graph-max-bs", "8", "--disable-cuda-graph"])
    config = config_from_args(EngineConfig, args)
    assert config.cuda_graph_bs == (1, 2, 8) and config.cuda_graph_max_bs == 8 and config.disable_cuda_graph


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("graph-ckpt")
    return {preset: write_tiny_model(root / preset, preset=preset, seed=3)
            for preset in ("tiny", "tiny-moe", "tiny-deepseek")}


async def _serve(engine: Engine, waves: list[list[list[int]]]) -> list:
    """Each wave's prompts at once (mixed lengths and output lengths, so the decode batch shrinks
    through sizes that pad), waves one after another (later ones hit the earlier ones' cache)."""
    async def one(prompt, room, new_tokens):
        params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True, logprobs=True,
                                top_logprobs=2)
        return [(o.token_id, o.logprob, tuple(o.top_logprobs))
                async for o in generate(engine, prompt, params, room)]
    results = []
    for w, wave in enumerate(waves):
        results += await asyncio.gather(*(one(p, f"w{w}r{i}", 3 + 2 * i) for i, p in enumerate(wave)))
    return results


@pytest.mark.parametrize("preset,dtype", [("tiny", "float32"), ("tiny", "bfloat16"),
                                          ("tiny-moe", "float32"), ("tiny-deepseek", "float32")])
async def test_padded_batch_gives_the_unpadded_tokens(checkpoints, preset, dtype):
    first = random_prompts([40, 9, 75, 23, 58, 3, 31], seed=7)
    # shares first[0]'s and first[2]'s leading pages (16-token pages), then goes its own way
    tails = random_prompts([5, 20, 11], seed=8)
    second = [first[0][:32] + tails[0], first[2][:64] + tails[1], first[2][:48] + tails[2], *first[3:5]]
    waves = [first, second]
    runs, stats = {}, {}
    for name, flags in (("eager", {}), ("padded", {"cuda_graph_bs": SIZES})):
        engine = start_engine(checkpoints[preset], dtype=dtype, cpu_kernels="on", num_threads=2, **flags)
        try:
            runs[name] = await _serve(engine, waves)
            stats[name] = engine.stats()
            padded_steps = engine.graphs.steps_by_size if engine.graphs is not None else None
        finally:
            engine.shutdown()
    assert runs["padded"] == runs["eager"]
    assert stats["padded"].prefix_hit_tokens >= 32 + 64 + 48 and stats["padded"].used_pages == 0
    assert padded_steps is not None and not stats["padded"].cuda_graph  # CPU: replayed eagerly
    # the runner took decode steps, some of them padded (e.g. 7 rows as 8, 3 as 4)
    assert any(rows < size for rows, size in padded_steps), padded_steps


def test_padded_rows_write_only_the_scratch_page(checkpoints):
    engine = Engine.load(EngineConfig(model_path=str(checkpoints["tiny"]), num_pages=64, cpu_kernels="on",
                                      num_threads=2, cuda_graph_bs=(4,)))
    graphs = engine.graphs
    assert graphs is not None and graphs.scratch_page == engine.pool.num_pages - 1 == engine.pages.num_pages
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    for i, prompt in enumerate(random_prompts([20, 33, 7], seed=9)):
        engine.add_unstreamed(EngineRequest(f"r{i}", prompt, params))
    while any(r.num_computed < r.num_prompt for r in engine.scheduler.requests.values()):
        engine.thread.step()  # the prompts (eager), until all three decode
    size = engine.pages.page_size
    slots = {r.page_ids[r.num_computed // size] * size + r.num_computed % size
             for r in engine.scheduler.requests.values()}
    before = engine.pool.buffer.clone()
    engine.thread.step()  # three rows, run as four
    assert graphs.steps_by_size == {(3, 4): 1}
    # [page, layer, k/v, offset, head, dim] -> which (page, offset) slots changed
    changed = (engine.pool.buffer != before).flatten(start_dim=4).any(dim=-1).any(dim=1).any(dim=1)
    written = {int(page) * size + int(offset) for page, offset in changed.nonzero().tolist()}
    assert written == slots | {graphs.scratch_slot}
    engine.shutdown()


def _table(runner, batch) -> list[list[int]]:
    """The page table a step of `batch` reads: each row's first pages, as many as it has."""
    size = runner.padded_size(len(batch.decodes))
    runner._fill(batch, size)
    table = runner.table_rows.index_select(0, runner.row_of_batch[:size])
    lengths = [len(c.page_ids) for c in batch.decodes] + [1] * (size - len(batch.decodes))
    return [row[:n] for row, n in zip(table.tolist(), lengths, strict=True)]


def test_page_rows_follow_their_requests():
    """The page-table rows a request keeps while it decodes: new pages written as they come, a row
    freed when its request leaves the batch and reused by another, a list given back and refilled
    in place written whole, padded rows on the scratch page."""
    from types import SimpleNamespace

    from engine.graph_runner import DecodeGraphRunner
    from engine.scheduler import ScheduledChunk, SchedulerOutput

    pool = SimpleNamespace(device=torch.device("cpu"), layout=SimpleNamespace(page_size=4), buffer=None)
    runner = DecodeGraphRunner(None, pool, (1, 2, 4), max_seq_len=64, scratch_page=99, capture=False)
    a, b, c = [1, 2], [5], [7, 8, 9]

    def step(*pages: list[int]) -> SchedulerOutput:
        chunks = [ScheduledChunk(f"r{id(p)}", [3], 4 * len(p) - 1, p, True) for p in pages]
        return SchedulerOutput(decodes=chunks)

    assert _table(runner, step(a, b, c)) == [[1, 2], [5], [7, 8, 9], [99]]
    a.append(3)
    b.append(6)
    assert _table(runner, step(a, b, c)) == [[1, 2, 3], [5, 6], [7, 8, 9], [99]]
    assert _table(runner, step(c, a)) == [[7, 8, 9], [1, 2, 3]]  # b left: its row is free
    d = [11, 12, 13, 14]
    assert _table(runner, step(c, d, a)) == [[7, 8, 9], [11, 12, 13, 14], [1, 2, 3], [99]]
    a.clear()  # given back, then refilled in place with other pages
    a.extend([20, 21])
    assert _table(runner, step(a, d)) == [[20, 21], [11, 12, 13, 14]]
    runner.forget_rows()
    a[0] = 30  # after an eager step nothing is trusted: rows are written whole again
    assert _table(runner, step(a)) == [[30, 21]]
