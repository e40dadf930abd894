"""Which encoder a language-only worker calls (services/worker/encoders.py): least loaded first,
each in turn among equals, never one already tried for this request."""

from __future__ import annotations

from libkv.embedding_pool import EmbeddingPool
from libkv.transfer import create_backend
from services.common.security import GrpcSecurity
from services.worker.encoders import EncoderClient
from services.worker.epd_config import EpdConfig


def client(urls: tuple[str, ...]) -> EncoderClient:
    pool = EmbeddingPool(hidden=8, dtype="float32", num_pages=4)
    backend = create_backend("fake")  # moves nothing: only the choice of encoder is under test
    backend.register(pool)
    return EncoderClient(EpdConfig(encoder_urls=urls), model_name="m", pool=pool, backend=backend,
                         security=GrpcSecurity())


def test_urls_are_grpc_addresses():
    assert EpdConfig(encoder_urls=("http://127.0.0.1:30002", "127.0.0.1:30003/")).encoder_addresses() == [
        "127.0.0.1:30002", "127.0.0.1:30003"]


def test_equals_take_turns_and_the_least_loaded_wins():
    encoders = client(("a:1", "b:2", "c:3"))
    candidates = ["a:1", "b:2", "c:3"]
    assert [encoders._pick(candidates, []) for _ in range(4)] == ["a:1", "b:2", "c:3", "a:1"]
    encoders._inflight.update({"a:1": 2, "b:2": 1, "c:3": 3})
    assert encoders._pick(candidates, []) == "b:2"
    assert encoders._pick(candidates, ["b:2"]) == "a:1"
    assert encoders._pick(candidates, candidates) is None
