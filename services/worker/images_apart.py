"""Worker requests whose images are read as views into the received bytes, not copied out by protobuf.

Why: a worker's engine thread and its gRPC handlers share one GIL. Parsing a GenerateRequest with
30 MB of images copies them into the message (about 20 ms, mostly page faults) and taking them out as
Python bytes copies them again (20 ms more), each holding the GIL, so every stream the worker runs
stopped for both (measured with `pdserve bench big-bodies`: 50-190 ms stretches on the worker's loop
per big body). Here a large request's images field is cut out of the wire bytes
(services/common/bytes_field_wire.py) and the rest parsed as usual: the handler gets an ImagesApart,
which answers every attribute as the message does except `images`, a tuple of memoryviews into the
bytes gRPC received. Consumers take any buffer (engine.multimodal.decode reads them through BytesIO);
a decode worker forwards them to its prefill in the wire bytes it sends (decode/prefill_client.py).

A Generate naming an `image_ticket` gets the images the gateway uploaded to the worker's image drop
(services/common/image_drop.py) the same way, as views; a ticket the drop does not hold gives a
TicketNotHeld, which the request's parse refuses.

Who calls: launch_server binds Worker.Generate and Prefill.Prefill with `adder()`'s deserializers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import Message

from protos.v1 import worker_pb2
from services.common.bytes_field_wire import split_bytes_field
from services.common.grpc_server import adder_with_deserializers
from services.common.image_drop import ImageDrop

APART_FROM_BYTES = 1 << 20  # a smaller request parses as usual: its copies are short


class ImagesApart:
    """A request message parsed without its images field; `images` holds the field's values as
    views into the received bytes, in order. Every other attribute is the message's."""

    __slots__ = ("message", "images")

    def __init__(self, message: Message, images: tuple[memoryview, ...]) -> None:
        self.message = message
        self.images = images

    def __getattr__(self, name: str) -> Any:
        return getattr(self.message, name)

    def __repr__(self) -> str:
        return f"ImagesApart({type(self.message).__name__}, {len(self.images)} images)"


class TicketNotHeld(tuple):
    """The `images` of a request naming an image-drop ticket this worker does not hold (never
    uploaded here, taken already, expired, or no drop): its parse refuses it (services/worker/wire.py)."""


def images_apart(message_type: type[Message], field_number: int,
                 drop: ImageDrop | None = None) -> Callable[[bytes], Any]:
    """A request deserializer: `message_type` parsed, as an ImagesApart when it is large and holds
    images (repeated bytes field `field_number`), or when it names images uploaded to `drop`
    (its `image_ticket`, taken here, once)."""
    takes_tickets = "image_ticket" in message_type.DESCRIPTOR.fields_by_name

    def deserialize(wire: bytes) -> Any:
        if len(wire) < APART_FROM_BYTES:
            message = message_type.FromString(wire)
        else:
            rest, images = split_bytes_field(wire, field_number)
            message = message_type.FromString(rest)
            if images:
                return ImagesApart(message, tuple(images))
        if not takes_tickets or not message.image_ticket:
            return message
        taken = drop.take(message.image_ticket) if drop is not None else None
        return ImagesApart(message, taken if taken is not None else TicketNotHeld())

    return deserialize


def adder(service: str, drop: ImageDrop | None = None) -> Callable[[Any, grpc.aio.Server], None]:
    """`add_*_to_server` for the Worker or Prefill service with its image-carrying method's requests
    read by `images_apart` (Worker.Generate's tickets taken from `drop`)."""
    descriptor = worker_pb2.DESCRIPTOR.services_by_name[service]
    if service == "Worker":
        deserializers = {"Generate": images_apart(worker_pb2.GenerateRequest,
                                                  worker_pb2.GenerateRequest.IMAGES_FIELD_NUMBER, drop)}
    elif service == "Prefill":
        deserializers = {"Prefill": images_apart(worker_pb2.PrefillRequest,
                                                 worker_pb2.PrefillRequest.IMAGES_FIELD_NUMBER)}
    else:
        raise ValueError(f"no images travel in pdserve.v1.{service}")
    return adder_with_deserializers(descriptor, deserializers)
