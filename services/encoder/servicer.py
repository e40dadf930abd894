"""The encoder service's pdserve.v1.Encoder: images in, embeddings written into the caller's pages.

One Encode call, in order (nothing is written before step 2 succeeded):
  1. check the call: model, the caller's embedding layout and backend (FAILED_PRECONDITION naming
     both values), page ids against the rows asked for (INVALID_ARGUMENT);
  2. connect to the caller's endpoint and read, through the transfer engine, that every
     destination page is bound to (room, grant): a forged or stale call is refused with
     PERMISSION_DENIED before any image is decoded;
  3. decode and preprocess the images, run the vision tower (one call at a time: torch's threads
     are the machine's), check each image's rows against what the caller expects;
  4. copy the rows into staging pages of this service's own pool, checksum them, write them into
     the caller's pages, and answer with the checksums once the write is done. The caller compares
     its pages with them before it reads a row (libkv.landing), exactly as decode does with KV.
A call cancelled mid-write (the caller's deadline) aborts its write and returns only when nothing
more can land; staging pages are freed in every case.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc

from engine.models.vision import VisionTower
from engine.multimodal.decode import MAX_IMAGES, decode_image, processor_config
from libkv.embedding_pool import EmbeddingPages, EmbeddingPool, PagesExhausted
from libkv.layout import LayoutMismatch
from libkv.transfer import BackendMismatch, GrantRefused, PeerUnreachable, TransferBackend, TransferError
from protos.v1 import encoder_pb2, encoder_pb2_grpc
from services.encoder.metrics import EncoderMetrics
from services.worker.rooms import finish_despite_cancel
from services.worker.wire import endpoint_from_proto

log = logging.getLogger("pdserve.encoder")


class EncoderServicer(encoder_pb2_grpc.EncoderServicer):
    """Called by language-only workers (services/worker/encoders.py)."""

    def __init__(self, *, model_name: str, model_path: str, tower: VisionTower, pool: EmbeddingPool,
                 backend: TransferBackend, metrics: EncoderMetrics, transfer_timeout_s: float) -> None:
        self.model_name, self.model_path = model_name, model_path
        self.tower, self.pool, self.backend, self.metrics = tower, pool, backend, metrics
        self.pages = EmbeddingPages(pool.num_pages)
        self.transfer_timeout_s = transfer_timeout_s
        self._tower_lock = threading.Lock()

    async def Encode(self, request: encoder_pb2.EncodeRequest, context: grpc.aio.ServicerContext):
        try:
            return await self._encode(request, context)
        except grpc.aio.AbortError:
            self.metrics.refused.inc()
            raise

    async def _encode(self, request: encoder_pb2.EncodeRequest, context: grpc.aio.ServicerContext):
        room = request.room
        if request.model and request.model != self.model_name:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"this encoder serves model {self.model_name!r}, not {request.model!r}")
        if not request.images or len(request.images) != len(request.image_rows):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{len(request.images)} images but {len(request.image_rows)} row counts")
        if len(request.images) > MAX_IMAGES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{len(request.images)} images in one call; at most {MAX_IMAGES}")
        dst_pages = list(request.dst_page_ids)
        num_rows = sum(request.image_rows)
        if len(dst_pages) != self.pool.pages_for(num_rows):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{num_rows} rows take {self.pool.pages_for(num_rows)} pages of "
                                f"{self.pool.rows_per_page} rows, got {len(dst_pages)} page ids")
        try:
            endpoint = endpoint_from_proto(request.dst_endpoint)
            if any(not 0 <= p < endpoint.num_pages for p in dst_pages):
                raise ValueError(f"page ids outside the caller's pool of {endpoint.num_pages} pages")
            peer = await asyncio.to_thread(self.backend.connect, endpoint)
        except (LayoutMismatch, BackendMismatch) as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"room {room}: {exc}")
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"room {room}: {exc}")
        except TransferError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"room {room}: cannot reach the caller: {exc}")
        try:
            await asyncio.to_thread(self.backend.verify_grant, peer, dst_pages, key=room, grant=request.grant)
        except GrantRefused as exc:
            log.warning("room %s: refused: %s", room, exc)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"room {room}: the caller did not grant these embedding pages: {exc}")
        except (PeerUnreachable, TransferError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"room {room}: cannot check the caller's grant: {exc}")
        try:
            embeddings = await asyncio.to_thread(self._run_tower, list(request.images),
                                                 list(request.image_rows))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"room {room}: {exc}")
        try:
            src_pages = self.pages.allocate(len(dst_pages))
        except PagesExhausted as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"room {room}: {exc}")
        try:
            sums, nbytes = await self._write(peer, room, request.grant, src_pages, dst_pages, embeddings)
        except (TransferError, asyncio.TimeoutError) as exc:  # TimeoutError itself only from 3.11 on
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"room {room}: embedding transfer failed: {exc}")
        finally:
            self.pages.free(src_pages)
        self.metrics.bytes_sent.inc(nbytes)
        return encoder_pb2.EncodeResponse(page_checksums=sums, embedding_bytes=nbytes)

    def _run_tower(self, blobs: list[bytes], expected_rows: list[int]):
        config = processor_config(self.model_path)
        images = [config.preprocess(decode_image(blob, i)) for i, blob in enumerate(blobs)]
        rows = [image.num_tokens(self.tower.merge_size) for image in images]
        if rows != expected_rows:
            raise ValueError(f"the images make {rows} embedding rows, the caller expects {expected_rows}")
        with self._tower_lock:
            start = time.perf_counter()
            embeddings = self.tower.encode(images)
            self.metrics.encode_seconds.inc(time.perf_counter() - start)
        self.metrics.images.inc(len(images))
        return embeddings

    async def _write(self, peer, room: str, grant: bytes, src_pages: list[int], dst_pages: list[int],
                     embeddings) -> tuple[list[int], int]:
        """Stage, checksum and write; on cancellation or timeout abort the write before returning."""
        self.pool.put(src_pages, embeddings)
        sums = self.backend.page_checksums_for(peer, src_pages, key=room)
        handle = await asyncio.to_thread(self.backend.write, peer, src_pages, dst_pages, key=room,
                                         grant=grant)
        try:
            await asyncio.wait_for(self.backend.wait(handle), timeout=self.transfer_timeout_s)
        except BaseException:
            await finish_despite_cancel(asyncio.to_thread(self.backend.abort, handle))
            raise
        return sums, handle.nbytes
