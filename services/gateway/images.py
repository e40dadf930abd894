"""The images of a chat request: `image_url` parts with `data:` URLs, as bytes for the worker.

Only inline `data:image/{png,jpeg,webp};base64,...` URLs are taken; a remote http(s) URL is
refused (fetching one is not implemented). The bytes go to the worker unopened: it decodes and
checks them (engine.multimodal.decode: not an image, truncated, too many pixels each answer 400
through the worker's INVALID_ARGUMENT), off its event loop. base64 decoding here is bounded by
the request body limit; large payloads are decoded off the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import binascii

from services.gateway.errors import bad_request
from services.gateway.protocol import ChatCompletionRequest

MAX_IMAGES = 16  # per request, as the worker's limit (engine.multimodal.decode.MAX_IMAGES)
MIME_TYPES = ("image/png", "image/jpeg", "image/webp")
INLINE_BYTES = 64 * 1024  # smaller payloads are decoded inline: a thread hop costs more


def image_urls(body: ChatCompletionRequest) -> list[str]:
    return [part.image_url.url for message in body.messages if isinstance(message.content, list)
            for part in message.content if part.type == "image_url" and part.image_url is not None]


def _decode(urls: list[str]) -> list[bytes]:
    blobs = []
    for index, url in enumerate(urls):
        if not url.startswith("data:"):
            scheme = url.split(":", 1)[0] if ":" in url else "?"
            raise bad_request(f"image {index}: only data: URLs are accepted, not {scheme}: URLs",
                              param="messages")
        header, _, payload = url[5:].partition(",")
        mime, _, encoding = header.partition(";")
        if mime.lower() not in MIME_TYPES or encoding.lower() != "base64":
            raise bad_request(f"image {index}: expected data:image/png, image/jpeg or image/webp with ;base64, "
                              f"got data:{header[:60]}", param="messages")
        try:
            blobs.append(base64.b64decode(payload, validate=True))
        except (binascii.Error, ValueError):
            raise bad_request(f"image {index}: the data URL is not valid base64", param="messages") from None
    return blobs


async def request_images(body: ChatCompletionRequest, multimodal: bool) -> list[bytes]:
    """The request's images in prompt order (empty without image parts); 400s for what the
    gateway can tell is wrong without opening them. `multimodal`: the model takes images."""
    urls = image_urls(body)
    if urls and not multimodal:
        raise bad_request("images sent to a text-only model: this model takes text content parts only",
                          param="messages")
    if len(urls) > MAX_IMAGES:
        raise bad_request(f"{len(urls)} images in one request; at most {MAX_IMAGES}", param="messages")
    if sum(len(u) for u in urls) <= INLINE_BYTES:
        return _decode(urls)
    return await asyncio.to_thread(_decode, urls)
