"""EncoderClient: how a --language-only worker gets its requests' image embeddings (EPD).

Per request, before the engine sees it: look each image up in the embedding cache by digest;
send the others to one encoder (the least loaded of `--encoder-urls` or of the registry's
encoders of this model, round robin among equals) with pages of this worker's embedding pool
reserved, poisoned and granted for the call (the KV rules: libkv.transfer.grants, libkv.landing);
wait until the pages hash to the checksums the encoder answers with, copy the rows out, cache
them, and free the pages. The pages are released and freed whatever happens: an encoder that
fails, dies or freezes past --encoder-timeout costs one retry on another encoder, then the
request fails with EncoderUnavailable (UNAVAILABLE to the gateway, a 503 to the client).

A frozen encoder that wakes up later cannot write into pages handed on since: its grant was
released first, and an encoder reads the grant before it writes. (A write already past its grant
check when it froze is the one-sided engines' known window; see libkv.transfer.interface.)
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections.abc import Sequence

import grpc
import torch

from engine.multimodal.inputs import ImageInput
from libkv.embedding_pool import EmbeddingPages, EmbeddingPool, PagesExhausted
from libkv.landing import wait_landed
from libkv.transfer import TransferBackend
from protos.v1 import common_pb2, encoder_pb2, encoder_pb2_grpc
from services.common.channels import open_channel
from services.common.registry_client import RegistryClient
from services.common.security import GrpcSecurity
from services.worker.embedding_cache import EmbeddingCache
from services.worker.epd_config import EpdConfig
from services.worker.metrics import WorkerMetrics
from services.worker.wire import endpoint_to_proto

log = logging.getLogger("pdserve.worker")

# An encoder's failure that another encoder may not have: try the next one.
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
              grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
              grpc.StatusCode.INTERNAL)
_REGISTRY_REFRESH_S = 1.0


class EncoderUnavailable(Exception):
    """No encoder produced the embeddings (none known, or every try failed): retryable elsewhere."""


class EncoderRefused(Exception):
    """An encoder refused the images themselves (`code`: INVALID_ARGUMENT, FAILED_PRECONDITION, ...)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class EncoderClient:
    """Owned by the worker's runtime; `embeddings` is called by the servicer per request."""

    def __init__(self, epd: EpdConfig, *, model_name: str, pool: EmbeddingPool, backend: TransferBackend,
                 security: GrpcSecurity) -> None:
        self.epd, self.model_name, self.pool = epd, model_name, pool
        self.backend, self.security = backend, security
        self.pages = EmbeddingPages(pool.num_pages)
        self.cache = EmbeddingCache(epd.embedding_cache_size)
        self.registry: RegistryClient | None = None  # set once the worker registered (no --encoder-urls)
        self._static = epd.encoder_addresses()
        self._known: list[str] = []
        self._known_at = 0.0
        self._inflight: dict[str, int] = {}
        self._turn = itertools.count()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._calls = itertools.count()

    async def embeddings(self, room: str, blobs: Sequence[bytes | memoryview], images: Sequence[ImageInput],
                         merge_size: int) -> torch.Tensor:
        """The rows of every image of a request, [sum of their tokens, hidden], in order."""
        rows: list[torch.Tensor | None] = [self.cache.get(image.digest) for image in images]
        missing: dict[int, int] = {}  # digest -> index of its first image (the same picture twice: once)
        for i, (image, found) in enumerate(zip(images, rows, strict=True)):
            if found is None:
                missing.setdefault(image.digest, i)
        if missing:
            picked = list(missing.values())
            counts = [images[i].num_tokens(merge_size) for i in picked]
            fetched = await self._fetch(room, [blobs[i] for i in picked], counts)
            by_digest = dict(zip(missing, torch.split(fetched, counts), strict=True))
            for digest, values in by_digest.items():
                self.cache.put(digest, values)
            rows = [found if found is not None else by_digest[image.digest]
                    for image, found in zip(images, rows, strict=True)]
        return torch.cat(rows)  # type: ignore[arg-type]

    async def _fetch(self, room: str, blobs: list[bytes | memoryview], counts: list[int]) -> torch.Tensor:
        tried: list[str] = []
        failures: list[str] = []
        for _ in range(2):  # one retry, on another encoder
            address = self._pick(await self._encoders(), tried)
            if address is None:
                break
            tried.append(address)
            try:
                return await self._call(address, room, blobs, counts)
            except EncoderUnavailable as exc:
                log.warning("room %s: encoder %s failed: %s", room, address, exc)
                failures.append(f"{address}: {exc}")
        if not tried:
            raise EncoderUnavailable("no encoder known (give --encoder-urls, or start --encoder-only workers "
                                     "of this model registered with --bootstrap)")
        raise EncoderUnavailable(f"every encoder tried failed: {'; '.join(failures)}")

    async def _encoders(self) -> list[str]:
        if self._static:
            return self._static
        if self.registry is None:
            return []
        if time.monotonic() - self._known_at > _REGISTRY_REFRESH_S:
            try:
                found = await self.registry.list(role=common_pb2.WORKER_ROLE_ENCODER, model=self.model_name)
                self._known, self._known_at = sorted(w.grpc_address for w in found), time.monotonic()
            except grpc.aio.AioRpcError as exc:  # keep the last list: the registry may be back soon
                log.warning("cannot list encoders: %s %s", exc.code().name, exc.details())
        return self._known

    def _pick(self, candidates: list[str], tried: list[str]) -> str | None:
        """The least loaded encoder not tried yet; among equals, each in turn."""
        left = [a for a in candidates if a not in tried]
        if not left:
            return None
        turn = next(self._turn) % len(left)
        rotated = left[turn:] + left[:turn]
        return min(rotated, key=lambda a: self._inflight.get(a, 0))

    def _stub(self, address: str) -> encoder_pb2_grpc.EncoderStub:
        if address not in self._channels:
            self._channels[address] = open_channel(address, self.security)
        return encoder_pb2_grpc.EncoderStub(self._channels[address])

    async def _call(self, address: str, room: str, blobs: list[bytes | memoryview],
                    counts: list[int]) -> torch.Tensor:
        num_rows = sum(counts)
        try:
            pages = self.pages.allocate(self.pool.pages_for(num_rows))
        except PagesExhausted as exc:
            raise EncoderUnavailable(str(exc)) from None
        key = f"{room}#emb{next(self._calls)}"  # one grant-table key per call: a retry never shares one
        grant = secrets.token_bytes(16)
        self._inflight[address] = self._inflight.get(address, 0) + 1
        try:
            self.pool.poison(pages)  # so a page matches its checksum only once this call's write landed
            self.backend.expect(key, pages, grant)
            request = encoder_pb2.EncodeRequest(
                # protobuf takes bytes only: a request's images are views into what it received
                # (services/worker/images_apart.py), copied here once
                room=key, model=self.model_name, images=[bytes(blob) for blob in blobs], image_rows=counts,
                dst_endpoint=endpoint_to_proto(self.backend.endpoint()), dst_page_ids=pages, grant=grant)
            try:
                response = await self._stub(address).Encode(request, timeout=self.epd.encoder_timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _RETRYABLE:
                    raise EncoderUnavailable(f"{exc.code().name}: {exc.details()}") from None
                raise EncoderRefused(exc.code(), exc.details() or exc.code().name) from None
            if len(response.page_checksums) != len(pages):
                raise EncoderUnavailable(f"{len(response.page_checksums)} checksums for {len(pages)} pages")
            differ = await wait_landed(self.pool, pages, list(response.page_checksums))
            if differ:
                raise EncoderUnavailable(f"{len(differ)} embedding pages differ from what the encoder sent")
            return self.pool.rows(pages, num_rows)
        finally:
            self._inflight[address] -= 1
            self.backend.release_expectation(key)
            self.pages.free(pages)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self.backend.close()


def add_embedding_metrics(metrics: WorkerMetrics, cache: EmbeddingCache, pages: EmbeddingPages) -> None:
    """A language-only worker's embedding side, on its WorkerMetrics: cache hits and misses, pages in
    use (all read at scrape time)."""
    metrics.counter_from("embedding_cache_hits_total", "Images whose embeddings came from the worker's "
                         "embedding cache", lambda: cache.hits)
    metrics.counter_from("embedding_cache_misses_total",
                         "Images sent to an encoder (not in the embedding cache)", lambda: cache.misses)
    metrics.gauge("embedding_cache_images", "Images in the embedding cache", lambda: len(cache))
    metrics.gauge("embedding_pages_used", "Embedding pages reserved for encoders' writes", lambda: pages.used)
