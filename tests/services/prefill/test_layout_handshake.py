"""A prefill and a decode worker whose KV layouts differ (MLA latent width, rope width, dtype, page
size, MLA against GQA) never exchange KV: prefill refuses decode's endpoint in the handshake with
FAILED_PRECONDITION naming every differing field, before computing or writing anything, and decode
answers its caller with the same status and message and frees the pages it reserved.

Real gRPC services and engines (the tiny GQA model) in this process. The layouts compared are those
of the transfer endpoints, so each side's backend is registered on a stand-in pool of the layout
under test: the handshake happens before any compute, and nothing is written to either pool.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from libkv.layout import KVLayout
from libkv.pool import KVPool
from protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.grpc_server import ServiceBinding, service_name, start_grpc_server
from services.decode.servicer import DecodeServicer
from services.prefill.servicer import PrefillServicer
from services.worker.config import WorkerConfig
from services.worker.metrics import HANDSHAKE, WorkerMetrics
from services.worker.runtime import WorkerRuntime
from services.worker.wire import endpoint_to_proto
from tests.engine.conftest import random_prompts
from tests.libkv.transfer.late_landing import LateLandingBackend
from tools.models.tiny_model import write_tiny_model

NUM_PAGES = 64
(PROMPT,) = random_prompts([40], seed=5)
DEEPSEEK = dict(num_layers=4, kv_lora_rank=512, qk_rope_head_dim=64, page_size=16, dtype="bfloat16")
GQA = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, dtype="bfloat16")
# (prefill's layout, decode's layout, what the refusal must name)
MISMATCHES = {
    "kv_lora_rank": (KVLayout.mla(**DEEPSEEK), KVLayout.mla(**{**DEEPSEEK, "kv_lora_rank": 256}),
                     ["kv_lora_rank: 512 vs 256", "head_dim: 576 vs 320"]),
    "qk_rope_head_dim": (KVLayout.mla(**DEEPSEEK), KVLayout.mla(**{**DEEPSEEK, "qk_rope_head_dim": 32}),
                         ["qk_rope_head_dim: 64 vs 32"]),
    "dtype": (KVLayout.mla(**DEEPSEEK), KVLayout.mla(**{**DEEPSEEK, "dtype": "float32"}),
              ["dtype: bfloat16 vs float32"]),
    "page_size": (KVLayout.mla(**DEEPSEEK), KVLayout.mla(**{**DEEPSEEK, "page_size": 32}),
                  ["page_size: 16 vs 32"]),
    "mla-vs-gqa": (KVLayout.mla(**DEEPSEEK), GQA,
                   ["num_kv_heads: 1 vs 2", "kv_lora_rank: 512 vs 0", "qk_rope_head_dim: 64 vs 0"]),
    "gqa-vs-mla": (GQA, KVLayout.mla(**DEEPSEEK),
                   ["num_kv_heads: 2 vs 1", "kv_lora_rank: 0 vs 512", "qk_rope_head_dim: 0 vs 64"]),
}


@dataclass
class Engines:
    model: Path
    prefill: Engine
    decode: Engine


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Iterator[Engines]:
    model = write_tiny_model(tmp_path_factory.mktemp("handshake") / "tiny", preset="tiny", seed=0)
    with _engine(model) as prefill, _engine(model) as decode:
        yield Engines(model, prefill, decode)


@contextmanager
def _engine(model: Path) -> Iterator[Engine]:
    engine = Engine.load(EngineConfig(model_path=str(model), num_pages=NUM_PAGES, num_threads=1))
    engine.start()
    try:
        yield engine
    finally:
        engine.shutdown()


@contextmanager
def _runtime(engines: Engines, role: str, layout: KVLayout) -> Iterator[WorkerRuntime]:
    """The `role` engine as a worker whose transfer endpoint states `layout`."""
    engine = getattr(engines, role)
    config = WorkerConfig(engine=EngineConfig(model_path=str(engines.model), num_pages=NUM_PAGES),
                          disaggregation_mode=role, disaggregation_transfer_backend="fake")
    backend = LateLandingBackend()
    backend.register(KVPool(layout, NUM_PAGES))
    try:
        yield WorkerRuntime(config=config, engine=engine, backend=backend,
                            metrics=WorkerMetrics(role, config.model_name))
    finally:
        backend.close()


@asynccontextmanager
async def _serving(runtime: WorkerRuntime, servicer, service: str, add):
    server = await start_grpc_server([ServiceBinding(service_name(worker_pb2, service), servicer, add)],
                                     "127.0.0.1", 0)
    try:
        yield server.address
    finally:
        await server.stop(0)


def _handshake_failures(runtime: WorkerRuntime) -> float:
    return runtime.metrics.registry.get_sample_value(
        "pdserve:pd_failures_total", {**runtime.metrics.labels, "stage": HANDSHAKE}) or 0.0


@pytest.mark.parametrize("case", sorted(MISMATCHES))
async def test_prefill_refuses_a_decode_endpoint_of_another_layout_naming_the_fields(engines, case):
    prefill_layout, decode_layout, named = MISMATCHES[case]
    with _runtime(engines, "prefill", prefill_layout) as prefill, \
            _runtime(engines, "decode", decode_layout) as decode:
        servicer = PrefillServicer(prefill)
        async with _serving(prefill, servicer, "Prefill",
                            worker_pb2_grpc.add_PrefillServicer_to_server) as address, \
                grpc.aio.insecure_channel(address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await worker_pb2_grpc.PrefillStub(channel).Prefill(worker_pb2.PrefillRequest(
                    room=f"room-{case}", prompt_token_ids=PROMPT, model=prefill.config.model_name,
                    sampling=common_pb2.SamplingParams(temperature=0, max_new_tokens=1),
                    dst_page_ids=[1, 2, 3], dst=endpoint_to_proto(decode.backend.endpoint()),
                    decode_worker_id="decode-7"), timeout=30)
        servicer.close()
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = refused.value.details()
    assert "decode worker decode-7 cannot take our KV: KV layout mismatch" in details, details
    for difference in named:
        assert difference in details, details
    assert f"[remote 127.0.0.1: {decode_layout.describe()}]" in details
    assert _handshake_failures(prefill) == 1
    assert not prefill.backend.sent  # nothing written
    assert engines.prefill.stats().used_pages == 0


@pytest.mark.parametrize("case", ["kv_lora_rank", "gqa-vs-mla"])
async def test_decode_answers_the_refusal_naming_the_fields_and_frees_its_pages(engines, case):
    prefill_layout, decode_layout, named = MISMATCHES[case]
    with _runtime(engines, "prefill", prefill_layout) as prefill, \
            _runtime(engines, "decode", decode_layout) as decode:
        prefill_servicer, decode_servicer = PrefillServicer(prefill), DecodeServicer(decode)
        try:
            async with _serving(prefill, prefill_servicer, "Prefill",
                                worker_pb2_grpc.add_PrefillServicer_to_server) as prefill_address, \
                    _serving(decode, decode_servicer, "Worker",
                             worker_pb2_grpc.add_WorkerServicer_to_server) as decode_address, \
                    grpc.aio.insecure_channel(decode_address) as channel:
                call = worker_pb2_grpc.WorkerStub(channel).Generate(worker_pb2.GenerateRequest(
                    room=f"room-{case}", prompt_token_ids=PROMPT, prefill_address=prefill_address,
                    sampling=common_pb2.SamplingParams(temperature=0, max_new_tokens=1)), timeout=30)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    [response async for response in call]
                # The reserved pages are freed once prefill confirms it writes nothing for the room.
                deadline = time.monotonic() + 10
                while engines.decode.stats().used_pages and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert engines.decode.stats().used_pages == 0
        finally:
            await decode_servicer.close()
            prefill_servicer.close()
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = refused.value.details()
    assert f"prefill {prefill_address}: " in details and "KV layout mismatch" in details, details
    for difference in named:
        assert difference in details, details
    assert _handshake_failures(decode) == 1
    assert not prefill.backend.sent
    assert engines.decode.stats().used_pages == 0 and engines.prefill.stats().used_pages == 0
