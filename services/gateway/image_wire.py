"""A worker's Generate call whose images are written into the message's wire bytes directly, off
the event loop.

Why: a GenerateRequest built with its images and then serialized copies every image byte twice, with
the GIL held, on the event loop (measured for 2 x 15 MB on this kind of machine, loaded: about 25 ms
building the message and 60-70 ms serializing it), which stalls every other stream the gateway relays.
Here the message is built and serialized without its images (a small copy), and each image is
appended as its own field (tag, length, bytes): one copy of the image bytes in all, made in a thread
(bytes.join releases the GIL; joining 30 MB on the loop held it 40-60 ms, measured). Protobuf reads
fields in any order and a repeated field's elements in the order they come, so the worker parses
exactly the message it would have got. What stays on the loop is gRPC's own copy of the message into
its buffers.

Images of 1 MB or more go beside the call instead, when the worker has an image drop
(services/common/image_drop.py): uploaded from a thread (the socket's sends release the GIL), then
the call names them by ticket. On the worker that keeps gRPC from copying them with the GIL held,
which stalled its other streams.

Who calls: dispatcher's one attempt on a route (`generate_call`), with the images ImageLoader made;
it reads the call and may cancel it (as WorkerHandle.cut does), as it would a grpc.aio call.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import grpc

from protos.v1 import worker_pb2
from services.common.bytes_field_wire import append_bytes_field
from services.common.image_drop import DropRefused, DropTarget, new_ticket, upload

_GENERATE = "/pdserve.v1.Worker/Generate"
DROP_FROM_BYTES = 1 << 20  # smaller images go in the call: a worker reads those in a moment
UPLOAD_TIMEOUT_S = 10.0  # per read or write of the upload: a frozen worker is given up on
# Uploads wait on peers: threads of their own, so a frozen worker holds these and not the loop's
# default executor, which the wire bytes and other work use.
_UPLOADS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="image-upload")

log = logging.getLogger("pdserve.gateway")


def encode_generate_request(request: worker_pb2.GenerateRequest, images: Sequence[bytes]) -> bytes:
    """The wire bytes of `request` with `images` as its images field (the request's own images
    field must be empty)."""
    return append_bytes_field(request.SerializeToString(), worker_pb2.GenerateRequest.IMAGES_FIELD_NUMBER,
                              images)


def _as_is(wire: bytes) -> bytes:
    return wire


class DropFinder(Protocol):
    """Where a worker's image drop is (services/gateway/workers.py WorkerHandle)."""

    async def image_drop(self) -> DropTarget | None: ...

    def forget_image_drop(self) -> None: ...


class ImageGenerateCall:
    """Worker.Generate with images, used as the dispatcher uses a grpc.aio unary-stream call: `read()`
    (grpc.aio.EOF at the end), `cancel()`, async iteration. The wire bytes are made in a thread at
    the first read, and the real call starts once they are; a cancel before that ends the wait
    (read raises CancelledError, as a cancelled grpc.aio call's does) and never starts the call."""

    def __init__(self, channel: grpc.aio.Channel, request: worker_pb2.GenerateRequest,
                 images: Sequence[bytes], drop: DropFinder | None = None) -> None:
        self._channel = channel
        self._request = request
        self._images = images
        self._drop = drop
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._encoding: asyncio.Future[bytes] | None = None
        self._cancelled = False

    async def _started(self) -> grpc.aio.UnaryStreamCall:
        if self._call is None:
            if self._cancelled:
                raise asyncio.CancelledError
            if self._encoding is None:
                self._encoding = asyncio.ensure_future(self._wire_bytes())
            wire = await asyncio.shield(self._encoding)  # a second reader waits for the same bytes
            if self._call is None:
                if self._cancelled:
                    raise asyncio.CancelledError
                self._images = ()  # the wire bytes hold them now
                call = self._channel.unary_stream(_GENERATE, request_serializer=_as_is,
                                                  response_deserializer=worker_pb2.GenerateResponse.FromString)
                self._call = call(wire)
        return self._call

    async def _wire_bytes(self) -> bytes:
        """The call's request: naming the images uploaded to the worker's drop when they are large
        and it has one, else holding them (also when the upload failed: the call then meets what
        the upload met, with the dispatcher's timeouts)."""
        size = sum(len(memoryview(image)) for image in self._images)
        if self._drop is not None and size >= DROP_FROM_BYTES:
            target = await self._drop.image_drop()
            if target is not None:
                ticket = new_ticket()
                try:
                    await asyncio.get_running_loop().run_in_executor(_UPLOADS, functools.partial(
                        upload, target.host, target.port, ticket, self._images, secret=target.secret,
                        timeout_s=UPLOAD_TIMEOUT_S))
                except DropRefused as exc:
                    self._drop.forget_image_drop()  # it may have restarted on another port: ask again
                    log.warning("room %s: image upload refused (%s); sending the images in the call",
                                self._request.room, exc)
                else:
                    self._request.image_ticket = ticket
                    return self._request.SerializeToString()
        return await asyncio.to_thread(encode_generate_request, self._request, self._images)

    async def read(self) -> Any:
        return await (await self._started()).read()

    def cancel(self) -> bool:
        if self._cancelled:
            return False
        self._cancelled = True
        if self._call is not None:
            return self._call.cancel()
        if self._encoding is not None:
            self._encoding.cancel()  # the thread finishes its join; nobody takes the bytes
        return True

    def cancelled(self) -> bool:
        return self._cancelled

    def __aiter__(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        while (response := await self.read()) is not grpc.aio.EOF:
            yield response


def generate_call(channel: grpc.aio.Channel, request: worker_pb2.GenerateRequest,
                  images: Sequence[bytes], drop: DropFinder | None = None) -> ImageGenerateCall:
    """Worker.Generate(request with `images`) on `channel`; large images go to the worker's image
    drop, found by `drop` (the WorkerHandle), when it has one."""
    return ImageGenerateCall(channel, request, images, drop)
