"""A request's images, as bytes for the worker: chat `image_url` parts and /generate `image_data`.

An image is given as a `data:image/{png,jpeg,webp};base64,...` URL, an http(s) URL whose host is in
`--allowed-media-domains` (fetched by media_fetch.MediaFetcher), or, in /generate's image_data
only, plain base64 (SGLang's forms; file paths are refused: the gateway reads no local files). The
limits (media_limits.MediaLimits) are checked before anything is decoded or fetched where they can
be: too many images is 400, an image or a request's images over the byte limits 413 (from the
base64 length for inline images, while reading for remote ones). The bytes go to the worker
unopened: it decodes and checks them (engine.multimodal.decode: not an image, truncated, too many
pixels from the header, each a 400 through the worker's INVALID_ARGUMENT), off its event loop.
Large base64 payloads are decoded off the gateway's event loop too; in a large body they were
already decoded in a pool process (large_bodies.py) and arrive here as `decoded`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

from fastapi import Request

from services.gateway.errors import GatewayError, bad_request
from services.gateway.large_bodies import DecodedImages
from services.gateway.media_fetch import MediaFetcher, payload_too_large
from services.gateway.media_limits import MediaLimits
from services.gateway.protocol import ChatCompletionRequest

MIME_TYPES = ("image/png", "image/jpeg", "image/webp")
INLINE_BYTES = 64 * 1024  # smaller payloads are decoded inline: a thread hop costs more
_BASE64 = re.compile(r"^[A-Za-z0-9+/\s]*={0,2}\s*$")


def image_urls(body: ChatCompletionRequest) -> list[str]:
    return [part.image_url.url for message in body.messages if isinstance(message.content, list)
            for part in message.content if part.type == "image_url" and part.image_url is not None]


@dataclass(frozen=True)
class _Inline:
    index: int
    payload: str  # base64 text
    bare: bool = False  # plain base64, not a data: URL: a path like /etc/passwd is base64's alphabet too


@dataclass(frozen=True)
class _Decoded:
    """An inline image a pool process decoded already (None: its payload was not valid base64)."""

    index: int
    blob: bytes | None


@dataclass(frozen=True)
class _Remote:
    index: int
    url: str


def _decoded_size(payload: str) -> int:
    """Bytes that `payload` (base64) decodes to, counted without decoding it."""
    stripped = payload.rstrip().rstrip("=")
    return len(stripped) * 3 // 4


class ImageLoader:
    """Turns a request's image sources into bytes within MediaLimits; one per app (app.state.images),
    closed at shutdown (its fetcher holds an HTTP client)."""

    def __init__(self, limits: MediaLimits) -> None:
        self.limits = limits
        self.fetcher = MediaFetcher(limits)

    async def close(self) -> None:
        await self.fetcher.close()

    async def load(self, sources: Sequence[str], *, multimodal: bool, param: str,
                   plain_base64: bool = False, decoded: DecodedImages | None = None) -> list[bytes]:
        """The images in order (empty without any). `multimodal`: the model takes images;
        `plain_base64`: a bare base64 string is an image too (/generate); `decoded`: the images
        large_bodies decoded out of this request's body, by the placeholders in `sources`."""
        if not sources:
            return []
        if not multimodal:
            raise bad_request("images sent to a text-only model: this model takes text only", param=param)
        limits = self.limits
        if len(sources) > limits.max_images:
            raise bad_request(f"{len(sources)} images in one request; at most {limits.max_images} "
                              "(--limit-mm-per-prompt)", param=param)
        try:
            return await self._load(sources, plain_base64, decoded)
        except GatewayError as exc:
            exc.param = exc.param or param
            raise

    async def _load(self, sources: Sequence[str], plain_base64: bool,
                    decoded: DecodedImages | None) -> list[bytes]:
        limits = self.limits
        parts = [self._classify(index, source, plain_base64, decoded) for index, source in enumerate(sources)]
        inline = [p for p in parts if isinstance(p, _Inline)]
        ready = [p for p in parts if isinstance(p, _Decoded)]
        for ready_part in ready:
            if ready_part.blob is None:
                raise bad_request(f"image {ready_part.index}: the data is not valid base64")
        total = 0
        sizes = [(p.index, _decoded_size(p.payload)) for p in inline]
        for index, size in sizes + [(p.index, len(p.blob or b"")) for p in ready]:
            if size > limits.max_image_bytes:
                raise payload_too_large(f"image {index}: {size} bytes; at most "
                                        f"{limits.max_image_bytes} per image (--max-image-bytes)")
            total += size
        if total > limits.max_request_image_bytes:
            raise payload_too_large(f"the request's images are {total} bytes; at most "
                                    f"{limits.max_request_image_bytes} per request "
                                    "(--max-request-image-bytes)")
        if sum(len(p.payload) for p in inline) <= INLINE_BYTES:
            blobs = _decode(inline)
        else:
            blobs = await asyncio.to_thread(_decode, inline)
        images: dict[int, bytes] = dict(zip((p.index for p in inline), blobs, strict=True))
        images.update((p.index, p.blob) for p in ready if p.blob is not None)
        total = sum(len(b) for b in images.values())
        deadline = time.monotonic() + limits.fetch_timeout_s
        for part in parts:  # one at a time: a request holds at most its byte budget in memory
            if isinstance(part, _Remote):
                room = limits.max_request_image_bytes - total
                request_binds = room < limits.max_image_bytes
                reason = (f"at most {limits.max_request_image_bytes} bytes of images per request "
                          "(--max-request-image-bytes)" if request_binds else
                          f"at most {limits.max_image_bytes} per image (--max-image-bytes)")
                blob = await self.fetcher.fetch(part.url, f"image {part.index}",
                                                min(room, limits.max_image_bytes),
                                                reason, deadline)
                images[part.index] = blob
                total += len(blob)
        return [images[index] for index in range(len(parts))]

    def _classify(self, index: int, source: str, plain_base64: bool,
                  decoded: DecodedImages | None) -> _Inline | _Decoded | _Remote:
        where = f"image {index}"
        if decoded is not None:
            found, blob = decoded.get(source)
            if found:
                return _Decoded(index, blob)
        if source.startswith("data:"):
            header, comma, payload = source[5:].partition(",")
            mime, _, encoding = header.partition(";")
            if not comma or mime.lower() not in MIME_TYPES or encoding.lower() != "base64":
                raise bad_request(f"{where}: expected data:image/png, image/jpeg or image/webp with ;base64, "
                                  f"got data:{header[:60]}")
            return _Inline(index, payload)
        scheme = source.split(":", 1)[0].lower() if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", source) else ""
        if scheme in ("http", "https"):
            self.fetcher.check_url(source, where)  # refused before anything is fetched or decoded
            return _Remote(index, source)
        if plain_base64 and not scheme and _BASE64.match(source[:4096]):  # JPEG starts "/9j/"
            return _Inline(index, source, bare=True)
        accepted = "a data: URL, an http(s) URL" + (" or base64" if plain_base64 else "")
        shown = f"a {scheme}: URL" if scheme else "a file path or other text"
        raise bad_request(f"{where}: expected {accepted}, got {shown} (local files are not read)")


def _decode(parts: Sequence[_Inline]) -> list[bytes]:
    blobs = []
    for part in parts:
        try:
            blobs.append(base64.b64decode("".join(part.payload.split()), validate=True))
        except (binascii.Error, ValueError):
            if part.bare and part.payload.startswith(("/", "~")):
                raise bad_request(f"image {part.index}: expected a data: URL, an http(s) URL or base64, got "
                                  "a file path or other text (local files are not read)") from None
            raise bad_request(f"image {part.index}: the data is not valid base64") from None
    return blobs


def image_loader(request: Request) -> ImageLoader:
    return request.app.state.images
