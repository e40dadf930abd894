"""Request body limits: a size limit (413) and a deadline for receiving the body (408).

Pure ASGI middleware. A Content-Length above the limit is refused before a byte of the body is
read (and before a client that sent `Expect: 100-continue` is told to send it). Bodies without a
length (chunked) are counted as they arrive, and refused the moment they pass the limit, so a
huge body is never read whole. A body that trickles in slower than the deadline allows is refused
too, so a slow client cannot hold a request open forever. Refusals close the connection: keeping it
would mean reading the rest of a body nobody wants. Nothing here buffers: the app reads the body
through the wrapped `receive` as it always does.
"""

from __future__ import annotations

import asyncio
import time

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.errors import send_error

_CLOSE = {"Connection": "close"}


def _too_large(limit: int) -> HTTPException:
    return HTTPException(413, f"request body is larger than the limit of {limit} bytes "
                              "(--max-request-body-bytes)", headers=_CLOSE)


def _too_slow(timeout_s: float) -> HTTPException:
    return HTTPException(408, f"request body not received within {timeout_s:g}s (--body-read-timeout)",
                         headers=_CLOSE)


def declared_length(scope: Scope) -> int | None:
    """The request's Content-Length, or None when it has none (chunked, or no body)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP server already refused a malformed length
    return None


class BodyLimit:
    """Refuse bodies over `max_bytes` (413) or slower than `read_timeout_s` in total (408)."""

    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = declared_length(scope)
        if length is not None and length > self.max_bytes:
            await send_error(send, _too_large(self.max_bytes))
            return
        await self.app(scope, self._limited(receive), send)

    def _limited(self, receive: Receive) -> Receive:
        received = 0
        body_done = False
        deadline = time.monotonic() + self.read_timeout_s

        async def limited_receive() -> Message:
            nonlocal received, body_done
            if body_done:  # later receives wait for a disconnect: no deadline on that
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise _too_slow(self.read_timeout_s) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _too_large(self.max_bytes)
                body_done = not message.get("more_body", False)
            return message

        return limited_receive
