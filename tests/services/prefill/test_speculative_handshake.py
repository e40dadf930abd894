"""Prefill and decode must run the same speculative-decoding config: prefill refuses a decode whose
config differs with FAILED_PRECONDITION naming each differing field, before computing or writing."""

from __future__ import annotations

import grpc
import pytest

from engine.config import EngineConfig
from engine.speculative.config import SpeculativeConfig
from protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.prefill.servicer import PrefillServicer
from services.worker.config import WorkerConfig
from services.worker.metrics import WorkerMetrics
from services.worker.runtime import WorkerRuntime
from services.worker.wire import speculative_from_proto, speculative_to_proto
from tests.engine.conftest import random_prompts
from tests.libkv.transfer.late_landing import LateLandingBackend
from tests.services.prefill.test_layout_handshake import _engine, _serving
from tools.models.tiny_model import write_tiny_model

NGRAM = SpeculativeConfig(speculative_algorithm="NGRAM", speculative_num_draft_tokens=5)
(PROMPT,) = random_prompts([20], seed=3)
# (prefill's config, decode's, what the refusal must name)
CASES = {
    "decode-only": (SpeculativeConfig(), NGRAM, "speculative_algorithm: None vs 'NGRAM'"),
    "prefill-only": (NGRAM, SpeculativeConfig(), "speculative_algorithm: 'NGRAM' vs None"),
    "draft-tokens": (NGRAM, SpeculativeConfig(speculative_algorithm="NGRAM", speculative_num_draft_tokens=3),
                     "speculative_num_draft_tokens: 5 vs 3"),
    # a draft model's path is its host's own: not compared, yet the peer's STANDALONE config must parse
    "standalone-draft-tokens": (
        SpeculativeConfig(speculative_algorithm="STANDALONE", speculative_draft_model_path="/p/draft"),
        SpeculativeConfig(speculative_algorithm="STANDALONE", speculative_draft_model_path="/d/draft",
                          speculative_num_draft_tokens=3),
        "speculative_num_draft_tokens: 5 vs 3"),
}


@pytest.fixture(scope="module")
def prefill_engine(tmp_path_factory):
    model = write_tiny_model(tmp_path_factory.mktemp("spec-handshake") / "tiny", preset="tiny", seed=0)
    with _engine(model) as engine:
        yield model, engine


def test_config_round_trips_through_the_wire() -> None:
    for config in (SpeculativeConfig(), NGRAM,
                   SpeculativeConfig(speculative_algorithm="NGRAM", speculative_num_steps=2)):
        assert speculative_from_proto(speculative_to_proto(config)) == config


def test_a_standalone_peer_agrees_whatever_its_draft_models_path() -> None:
    # Each side names its draft model by a path on its own host; only the agreed settings cross the wire.
    mine, theirs = (SpeculativeConfig(speculative_algorithm="STANDALONE", speculative_draft_model_path=path)
                    for path in ("/prefill/draft", "/decode/draft"))
    assert mine.differences(speculative_from_proto(speculative_to_proto(theirs))) == []
    assert NGRAM.differences(speculative_from_proto(speculative_to_proto(theirs))) == [
        "speculative_algorithm: 'NGRAM' vs 'STANDALONE'"]


@pytest.mark.parametrize("case", sorted(CASES))
async def test_prefill_refuses_a_decode_with_another_draft_config_naming_the_field(prefill_engine, case):
    model, engine = prefill_engine
    prefill_config, decode_config, named = CASES[case]
    config = WorkerConfig(engine=EngineConfig(model_path=str(model), num_pages=64,
                                              speculative=prefill_config),
                          disaggregation_mode="prefill", disaggregation_transfer_backend="fake")
    backend = LateLandingBackend()
    runtime = WorkerRuntime(config=config, engine=engine, backend=backend,
                            metrics=WorkerMetrics("prefill", config.model_name))
    servicer = PrefillServicer(runtime)
    try:
        async with _serving(runtime, servicer, "Prefill", worker_pb2_grpc.add_PrefillServicer_to_server) \
                as address, grpc.aio.insecure_channel(address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await worker_pb2_grpc.PrefillStub(channel).Prefill(worker_pb2.PrefillRequest(
                    room=f"room-{case}", prompt_token_ids=PROMPT, model=config.model_name,
                    sampling=common_pb2.SamplingParams(temperature=0, max_new_tokens=1), dst_page_ids=[1, 2],
                    speculative=speculative_to_proto(decode_config)), timeout=30)
    finally:
        servicer.close()
        backend.close()
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = refused.value.details()
    assert "speculative decoding config mismatch (prefill vs decode)" in details and named in details, details
    assert engine.stats().used_pages == 0 and not backend.sent
