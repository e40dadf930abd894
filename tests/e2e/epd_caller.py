"""A stand-in caller of an encoder service, run as its own process by tests/e2e/test_epd.py (a NIXL
agent must never live in the pytest process): it registers a real embedding pool with a real
backend, grants pages to a key, and calls Encode once with a forged grant and once with the right
one. Prints one JSON line: the forged call's status, whether its pages stayed untouched, and whether
the honest call's pages landed with the checksums the encoder sent.

    python -m tests.e2e.epd_caller ENCODER_ADDRESS BACKEND MODEL_NAME IMAGE_PATH ROWS
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys

import grpc

from libkv.embedding_pool import EmbeddingPool
from libkv.landing import wait_landed
from libkv.transfer import create_backend, exit_process
from protos.v1 import encoder_pb2, encoder_pb2_grpc
from services.worker.wire import endpoint_to_proto


async def main(address: str, backend_name: str, model: str, image: bytes, rows: int) -> dict:
    pool = EmbeddingPool(hidden=128, dtype="float32", num_pages=8)
    backend = create_backend(backend_name, timeout_s=10.0, host="127.0.0.1")
    backend.register(pool)
    pages = list(range(pool.pages_for(rows)))
    grant = secrets.token_bytes(16)
    pool.poison(list(range(pool.num_pages)))
    before = pool.page_checksums(list(range(pool.num_pages)))
    backend.expect("room-x", pages, grant)
    result: dict = {}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = encoder_pb2_grpc.EncoderStub(channel)

        def call(g: bytes, dst: list[int]):
            return stub.Encode(encoder_pb2.EncodeRequest(
                room="room-x", model=model, images=[image], image_rows=[rows], grant=g,
                dst_endpoint=endpoint_to_proto(backend.endpoint()), dst_page_ids=dst), timeout=60)

        for name, g, dst in (("forged_grant", secrets.token_bytes(16), pages),
                             ("ungranted_pages", grant, [p + len(pages) for p in pages])):
            try:
                await call(g, dst)
                result[name] = "OK"
            except grpc.aio.AioRpcError as exc:
                result[name] = exc.code().name
        result["untouched"] = pool.page_checksums(list(range(pool.num_pages))) == before
        response = await call(grant, pages)
        result["landed"] = not await wait_landed(pool, pages, list(response.page_checksums))
    backend.release_expectation("room-x")
    backend.close()
    return result


if __name__ == "__main__":
    encoder, backend_arg, model_arg, path, rows_arg = sys.argv[1:6]
    with open(path, "rb") as f:
        blob = f.read()
    print(json.dumps(asyncio.run(main(encoder, backend_arg, model_arg, blob, int(rows_arg)))), flush=True)
    exit_process(0)
