"""Part "graphs": decode steps as CUDA graphs (engine.graph_runner) against the same engine with
--disable-cuda-graph, on CUDA.

The dense presets (the Qwen3 tiny, the Llama with head_dim 48 and GQA 4:1) in fp32: greedy tokens
equal, logprobs within 1e-3 (a padded batch's GEMMs may take other cuBLAS kernels than the unpadded
one's, so the sums may differ in their last bits, as HF's batches do; on CPU the padding is exact:
tests/engine/test_graph_runner.py). Prompts of mixed lengths arrive together with different output
lengths, so the batch shrinks through padded sizes; a second wave hits the prefix cache. The engine
must say it replayed graphs (the log line's `cuda graph: True`) and have captured the sizes it ran.
MoE and MLA models run eagerly on CUDA so far (engine.graph_runner.plan_graphs says why).
"""

from __future__ import annotations

import asyncio

import pytest

from tests.gpu.hardware import require

require("graphs")

from engine.sampling import SamplingParams  # noqa: E402
from tests.engine.conftest import LLAMA_OVERRIDES, generate, random_prompts, start_engine  # noqa: E402
from tools.models.tiny_model import write_tiny_model  # noqa: E402

pytestmark = pytest.mark.gpu

LOGPROB_TOLERANCE = 1e-3


async def _serve(engine, waves):
    async def one(prompt, room, new_tokens):
        params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True, logprobs=True)
        return [(o.token_id, o.logprob) async for o in generate(engine, prompt, params, room)]
    results = []
    for w, wave in enumerate(waves):
        results += await asyncio.gather(*(one(p, f"w{w}r{i}", 4 + 3 * i) for i, p in enumerate(wave)))
    return results


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
async def test_graphs_on_and_off_decode_the_same(tmp_path, arch):
    overrides = LLAMA_OVERRIDES if arch == "llama" else {}
    ckpt = write_tiny_model(tmp_path / arch, preset="tiny", seed=4, arch=arch if arch == "llama" else None,
                            **overrides)
    first = random_prompts([40, 9, 300, 23, 58, 3, 31, 120, 77], seed=11)
    second = [first[2][:256] + [17, 18, 19], *first[4:8]]
    runs = {}
    for name, flags in (("eager", {"disable_cuda_graph": True}), ("graphs", {"cuda_graph_max_bs": 16})):
        engine = start_engine(ckpt, device="cuda", dtype="float32", **flags)
        try:
            runs[name] = await _serve(engine, [first, second])
            if name == "graphs":
                assert engine.graphs is not None and engine.graphs.capture
                assert engine.stats().cuda_graph  # the last step was a decode step of a captured size
                assert any(rows < size for rows, size in engine.graphs.steps_by_size)
                assert engine.stats().prefix_hit_tokens >= 256
            assert engine.stats().used_pages == 0
        finally:
            engine.shutdown()
    for eager, graphed in zip(runs["eager"], runs["graphs"], strict=True):
        assert [t for t, _ in graphed] == [t for t, _ in eager]
        assert max(abs(a - b) for (_, a), (_, b) in zip(eager, graphed, strict=True)) <= LOGPROB_TOLERANCE
