"""`pdserve bench gateway-relay`: one small run end to end (long: a real gateway in front of the
token sources, over gRPC and HTTP), and the token source's schedule (the messages a worker with that
--stream-interval sends)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from protos.v1 import common_pb2, worker_pb2
from tools.bench.token_source import StepClock, TokenSourceServicer


def test_source_sends_the_first_token_alone_then_interval_sized_messages():
    async def run() -> list[worker_pb2.GenerateResponse]:
        clock = StepClock(0.001)
        clock.start()
        source = TokenSourceServicer(clock, 4, worker_pb2.ModelInfo(), [(7, "a"), (8, "b")])
        request = worker_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3],
                                             sampling=common_pb2.SamplingParams(max_new_tokens=10))
        return [message async for message in source.Generate(request, None)]

    messages = asyncio.run(run())
    assert [list(m.token_ids) for m in messages] == [[7], [8, 7, 8, 7], [8, 7, 8, 7], [8]]
    assert "".join(t for m in messages for t in m.token_texts) == "ab" * 5
    assert [m.finish_reason for m in messages][-1] == common_pb2.FINISH_REASON_LENGTH
    assert not any(m.finish_reason for m in messages[:-1])
    assert (messages[-1].usage.prompt_tokens, messages[-1].usage.completion_tokens) == (3, 10)


@pytest.mark.e2e
@pytest.mark.long
@pytest.mark.timeout(300)
def test_small_relay_run_has_no_errors_and_reports_the_gateway(tmp_path: Path, qwen3_ckpt: Path):
    command = [sys.executable, "-m", "pdserve", "bench", "gateway-relay", "--model-path", str(qwen3_ckpt),
               "--requests", "40", "--rate", "20", "--output-len", "24", "--stream-interval", "4",
               "--sources", "2", "--workdir", str(tmp_path), "--json"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    figures = json.loads(out.stdout[out.stdout.index("{"):])
    assert figures["load"]["errors"] == 0
    assert figures["load"]["output_tokens"] == 40 * 24
    assert figures["gateway"]["cpu_ms_per_token"] > 0
    assert figures["client_ms"]["tpot_mean_over_sources"] > 0
