"""The gateway's server-sent-event responses: each event written as soon as it is ready, the
generation stopped as soon as the client leaves.

Starlette's StreamingResponse runs each response in an anyio task group whose second task listens
for the disconnect, and hands every event through every middleware's send wrapper (five of them
here). At fleet rates both were a measurable share of the gateway's CPU per relayed token
(`pdserve bench gateway-relay`), so SSEResponse sends the response start through the middlewares
(they count and track it, which is all they look at) and the events straight to the HTTP server's
own send, which `with_server_send` puts in the scope; one task writes the events while the response's
own task waits for the client to leave, and cancels the writer if it does (the body's generators
then close, cancelling the gRPC call and aborting the worker's request).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

SERVER_SEND = "pdserve.server_send"  # the scope key of the HTTP server's send (with_server_send)


def with_server_send(app: ASGIApp) -> ASGIApp:
    """`app` with the server's own send in each HTTP scope, for SSEResponse's events."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[SERVER_SEND] = send
        await app(scope, receive, send)

    return wrapped


class SSEResponse(StreamingResponse):
    """text/event-stream over an async iterator of events (str)."""

    def __init__(self, events: AsyncIterator[str], headers: dict[str, str]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        writer = asyncio.ensure_future(self._write(scope.get(SERVER_SEND, send)))
        watcher = asyncio.ensure_future(_client_left(receive))
        try:
            await asyncio.wait((writer, watcher), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the server is stopping this request
            writer.cancel()
            watcher.cancel()
            raise
        watcher.cancel()
        if writer.done():
            writer.result()  # a failure after the start: the server closes the connection
            return
        writer.cancel()  # the client left: stop the generation, nobody reads it
        # wait for the writer's cleanup without taking a cancellation of this task for the writer's
        await asyncio.wait((writer,))
        error = None if writer.cancelled() else writer.exception()
        if error is not None:
            raise error

    async def _write(self, send: Send) -> None:
        async for event in self.body_iterator:
            data = event.encode() if isinstance(event, str) else bytes(event)
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _client_left(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
