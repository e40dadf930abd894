"""A migrated generation keeps its LoRA adapter: the continuation runs under the same adapter, on a
pair that holds it (a decode without it is passed over, though the policy would pick it first)."""

from __future__ import annotations

import grpc

from protos.v1 import common_pb2
from services.gateway.dispatcher import Dispatcher, DispatchSettings
from services.gateway.metrics import GatewayMetrics
from services.gateway.workers import Router, WorkerPool
from tests.services.gateway.test_migration import PROMPT, FakeWorker, First, chunk, rpc_error, sampling


async def test_a_migrated_generation_continues_under_its_adapter() -> None:
    pool = WorkerPool()
    pool.add("127.0.0.1:1", "prefill", "m", lora_adapters={"x": "x@1"})
    serving = FakeWorker(pool.add("127.0.0.1:2", "decode", "m", lora_adapters={"x": "x@1"}),
                         [[chunk(10, 11), rpc_error(grpc.StatusCode.UNAVAILABLE)]])
    lacking = FakeWorker(pool.add("127.0.0.1:3", "decode", "m", lora_adapters={}), [])
    holding = FakeWorker(pool.add("127.0.0.1:4", "decode", "m", lora_adapters={"x": "x@1"}),
                         [[chunk(12, finish=common_pb2.FINISH_REASON_LENGTH, usage=(5, 1))]])
    dispatcher = Dispatcher(Router(pool, First(), First()), GatewayMetrics(pool),
                            DispatchSettings(retry_backoff_s=0))
    chunks = [c async for c in dispatcher.generate("r", "m", PROMPT, sampling(max_new_tokens=3), lora="x")]
    assert [t.token_id for c in chunks for t in c.tokens] == [10, 11, 12]
    assert [r.lora_adapter for r in serving.requests] == ["x"]
    assert lacking.requests == []  # first in the policy's order, but without `x`
    (continuation,) = holding.requests
    assert continuation.lora_adapter == "x" and list(continuation.prompt_token_ids) == PROMPT + [10, 11]
    assert continuation.prefill_address == "127.0.0.1:1"
