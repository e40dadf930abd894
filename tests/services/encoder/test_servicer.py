"""The encoder's checks of an Encode call (services/encoder/servicer.py), served in-process over gRPC
with the tiny-vl tower and the `fake` backend (which moves nothing: only the control plane is under
test here; tests/e2e/test_epd.py covers grants and bytes on mooncake and nixl)."""

from __future__ import annotations

import io

import grpc
import numpy as np
import pytest
import torch
from PIL import Image

from engine.models.config import ModelConfig
from engine.models.vision import VisionTower
from libkv.embedding_pool import EmbeddingPool
from libkv.transfer import TransferEndpoint, create_backend
from protos.v1 import encoder_pb2, encoder_pb2_grpc
from services.common.grpc_server import ServiceBinding, service_name, start_grpc_server
from services.encoder.metrics import EncoderMetrics
from services.encoder.servicer import EncoderServicer
from services.worker.wire import endpoint_to_proto

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    from tools.models.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("ckpt") / "tiny-vl", preset="tiny-vl", seed=0)


def png(size: int, seed: int) -> bytes:
    buffer = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture
async def encoder(vl_dir):
    config = ModelConfig.from_dir(vl_dir)
    pool = EmbeddingPool(config.hidden_size, "float32", 8)
    backend = create_backend("fake")
    backend.register(pool)
    servicer = EncoderServicer(model_name="tiny-vl", model_path=str(vl_dir), pool=pool, backend=backend,
                               tower=VisionTower.load(str(vl_dir), config, torch.float32,
                                                      torch.device("cpu")),
                               metrics=EncoderMetrics("tiny-vl"), transfer_timeout_s=10)
    server = await start_grpc_server([ServiceBinding(service_name(encoder_pb2, "Encoder"), servicer,
                                                     encoder_pb2_grpc.add_EncoderServicer_to_server)],
                                     "127.0.0.1", 0)
    async with grpc.aio.insecure_channel(server.address) as channel:
        yield servicer, encoder_pb2_grpc.EncoderStub(channel), backend.endpoint()
    await server.stop(0)
    backend.close()


def call(endpoint: TransferEndpoint, **fields) -> encoder_pb2.EncodeRequest:
    values = dict(room="r", model="tiny-vl", images=[png(64, 1)], image_rows=[4], dst_page_ids=[0],
                  dst_endpoint=endpoint_to_proto(endpoint), grant=b"g" * 16)
    values.update(fields)
    return encoder_pb2.EncodeRequest(**values)


async def test_good_call_answers_checksums_and_counts(encoder):
    servicer, stub, endpoint = encoder
    response = await stub.Encode(call(endpoint, images=[png(64, 1), png(96, 2)], image_rows=[4, 9],
                                      dst_page_ids=[3]))
    assert len(response.page_checksums) == 1 and response.embedding_bytes == 16 * 128 * 4
    assert servicer.metrics.images._value.get() == 2
    assert servicer.pages.used == 0


@pytest.mark.parametrize(("fields", "code", "message"), [
    ({"model": "other"}, grpc.StatusCode.FAILED_PRECONDITION, "serves model 'tiny-vl', not 'other'"),
    ({"dst_page_ids": [0, 1]}, grpc.StatusCode.INVALID_ARGUMENT, "4 rows take 1 pages of 16 rows, got 2"),
    ({"dst_page_ids": [8]}, grpc.StatusCode.INVALID_ARGUMENT, "outside the caller's pool of 8 pages"),
    ({"image_rows": [4, 4]}, grpc.StatusCode.INVALID_ARGUMENT, "1 images but 2 row counts"),
    ({"image_rows": [5]}, grpc.StatusCode.INVALID_ARGUMENT, "the images make [4] embedding rows"),
    ({"images": [b"not an image"]}, grpc.StatusCode.INVALID_ARGUMENT, "is not a PNG, JPEG or WebP image"),
])
async def test_bad_calls_are_refused_with_a_message(encoder, fields, code, message):
    servicer, stub, endpoint = encoder
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Encode(call(endpoint, **fields))
    assert refused.value.code() == code and message in refused.value.details()
    assert servicer.pages.used == 0 and servicer.metrics.images._value.get() == 0


async def test_another_embedding_layout_is_refused_naming_both(encoder):
    servicer, stub, endpoint = encoder
    other = EmbeddingPool(64, "float32", 8)
    foreign = TransferEndpoint(endpoint.backend, other.layout, endpoint.host, endpoint.num_pages,
                               endpoint.blob)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Encode(call(foreign))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "kv_lora_rank: 128 vs 64" in refused.value.details()  # the embedding width, this encoder's first
