"""What a request passes before it reaches the workers: the gateway's ASGI middleware, admission
control, and the guards the handlers call.

Middleware, outermost first (app.py installs it). All of it is pure ASGI (a BaseHTTPMiddleware
would buffer streams and hide client disconnects from the handlers) and passes other scopes
(lifespan) through untouched:

    RequestCounter  counts every answer by endpoint and status, refusals included
    InternalErrors  an exception escaping the app (a gateway bug) answers 500 and keeps the
                    connection (errors.py's handlers answer everything else)
    BodyLimit       413 for a body over `max_bytes`, 408 for one slower than `read_timeout_s`
    ApiKeyAuth      401 without the API key, before any body is read (only with --api-key)
    AdmissionScope  releases the admission tickets a request took when its ASGI call ends

Handlers then call RequestGuards, in this order: `check_fanout` (how many generations the body
asks for, refused with 400 beyond the limit), `admit` (admission control: waits for slots or
sheds with 429), then `encoder` (chat templating and tokenization off the event loop, prompts.py).

Body limits: a Content-Length above the limit is refused before a byte of the body is read (and
before a client that sent `Expect: 100-continue` is told to send it). Bodies without a length
(chunked) are counted as they arrive and refused the moment they pass the limit, so a huge body is
never read whole; one that trickles in slower than the deadline allows is refused too, so a slow
client cannot hold a request open forever. Both refusals close the connection: keeping it would
mean reading the rest of a body nobody wants. Nothing here buffers: the app reads the body through
the wrapped `receive` as it always does.

API key: OpenAI bearer tokens (`Authorization: Bearer KEY`), checked on every path, unknown ones
included (a client without the key cannot even learn which routes exist). `/health` stays open for
load balancers and orchestrators; `/metrics` is open unless `--metrics-require-api-key`; the
OpenAPI document and its viewers are open (they describe the API, they do not use it). The key is
compared in constant time, as SHA-256 digests so that not even its length shows in the timing.

Admission control: a bounded number of generations in flight per model, a bounded wait queue, 429
with Retry-After beyond it (load shedding instead of letting every client queue for minutes). A
request holds one slot per generation it starts (prompts x n, capped at the whole budget so that
any request can run alone), from before its prompt is tokenized until its response is fully sent
or the client is gone. A request that finds no free slots waits in FIFO order: only the head of
the queue may take slots, so a big request is not starved by small ones behind it. A full queue or
a wait longer than `queue_timeout_s` sheds the request. Protocol: the handler calls
`RequestGuards.admit` once; AdmissionScope releases the ticket when the ASGI call ends, whatever
way it ends (a streamed body finishing, an exception, a disconnect, a cancellation).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.errors import GatewayError, bad_request, error_response, send_error
from services.gateway.responses import until_disconnected

if TYPE_CHECKING:
    from services.gateway.metrics import GatewayMetrics
    from services.gateway.prompts import PromptEncoder

log = logging.getLogger("pdserve.gateway")

_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/generate", "/health", "/metrics")
OPEN_PATHS = frozenset({"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
_CLOSE = {"Connection": "close"}
_TICKETS = "pdserve.admission_tickets"


class HttpMiddleware:
    """Pure ASGI middleware for HTTP requests: `handle` sees them, other scopes pass through."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class RequestCounter(HttpMiddleware):
    """Counts responses by endpoint and status."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        super().__init__(app)
        self.metrics = metrics

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        endpoint = path if path in _ENDPOINTS else (
            "/v1/models" if path.startswith("/v1/models/") else "other")

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint=endpoint, status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


class InternalErrors(HttpMiddleware):
    """An exception escaping the app (a gateway bug) is logged and answered as a 500 error body,
    and the connection stays usable (Starlette's own last-resort handler re-raises, and uvicorn
    then resets it)."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            log.exception("unexpected error on %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise  # half a response is out: only closing the connection can tell the client
            await error_response(500, f"internal error: {type(exc).__name__}")(scope, receive, send)


# -- request bodies -----------------------------------------------------------------------------

def _too_large(limit: int, flags: str) -> HTTPException:
    return HTTPException(413, f"request body is larger than the limit of {limit} bytes ({flags})",
                         headers=_CLOSE)


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


if sys.version_info >= (3, 11):
    async def _receive_by(receive: Receive, deadline: float) -> Message:
        """receive(), or asyncio.TimeoutError at `deadline` (the loop's clock). A timeout scope, not
        wait_for: wait_for makes a task per call, and a 40 MB body arrives in hundreds of chunks,
        each one a receive on the event loop."""
        async with asyncio.timeout_at(deadline):
            return await receive()
else:
    async def _receive_by(receive: Receive, deadline: float) -> Message:
        return await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))


class BodyLimit(HttpMiddleware):
    """Refuse bodies over `max_bytes` (413, naming the `flags` that set it) or slower than
    `read_timeout_s` in total (408)."""

    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout_s: float,
                 flags: str = "--max-request-body-bytes") -> None:
        super().__init__(app)
        self.max_bytes = max_bytes
        self.flags = flags
        self.read_timeout_s = read_timeout_s

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        length = declared_length(scope)
        if length is not None and length > self.max_bytes:
            await send_error(send, _too_large(self.max_bytes, self.flags))
            return
        await self.app(scope, self._limited(receive), send)

    def _limited(self, receive: Receive) -> Receive:
        received = 0
        body_done = False
        deadline = asyncio.get_running_loop().time() + self.read_timeout_s  # the loop's clock

        async def limited_receive() -> Message:
            nonlocal received, body_done
            if body_done:  # later receives wait for a disconnect: no deadline on that
                return await receive()
            try:
                message = await _receive_by(receive, deadline)
            except asyncio.TimeoutError:
                raise _too_slow(self.read_timeout_s) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _too_large(self.max_bytes, self.flags)
                body_done = not message.get("more_body", False)
            return message

        return limited_receive


# -- API key ------------------------------------------------------------------------------------

def bearer_token(scope: Scope) -> bytes | None:
    """The token of an `Authorization: Bearer TOKEN` header (scheme case-insensitive), else None."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


class ApiKeyAuth(HttpMiddleware):
    """401 with an OpenAI error body unless the request carries the key (see module docstring)."""

    def __init__(self, app: ASGIApp, api_key: str, metrics_require_api_key: bool) -> None:
        super().__init__(app)
        self._key_digest = hashlib.sha256(api_key.encode("utf-8")).digest()
        self._open = OPEN_PATHS if metrics_require_api_key else OPEN_PATHS | {"/metrics"}

    def allows(self, scope: Scope) -> bool:
        if scope.get("path") in self._open:
            return True
        token = bearer_token(scope)
        return token is not None and hmac.compare_digest(hashlib.sha256(token).digest(), self._key_digest)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.allows(scope):
            await self.app(scope, receive, send)
            return
        has_token = bearer_token(scope) is not None
        message = ("Incorrect API key provided." if has_token else
                   "You didn't provide an API key. You need to provide your API key in an Authorization "
                   "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
        # A body the server will not read is drained by uvicorn to keep the connection; one of
        # unknown length (chunked) could be endless, so that connection is closed instead.
        headers = {"WWW-Authenticate": "Bearer"}
        if declared_length(scope) is None and _has_body(scope):
            headers["Connection"] = "close"
        response = error_response(401, message, code="invalid_api_key", type_="invalid_request_error",
                                  headers=headers)
        await response(scope, receive, send)


def _has_body(scope: Scope) -> bool:
    return any(name == b"transfer-encoding" for name, _ in scope.get("headers", ()))


# -- admission control --------------------------------------------------------------------------

@dataclass(frozen=True)
class AdmissionLimits:
    max_running: int
    max_waiting: int
    queue_timeout_s: float
    retry_after_s: int


class Ticket:
    """Slots one request holds; `release()` gives them back (idempotent)."""

    def __init__(self, queue: AdmissionQueue, slots: int) -> None:
        self._queue = queue
        self.slots = slots

    def release(self) -> None:
        if self.slots:
            slots, self.slots = self.slots, 0
            self._queue._release(slots)


class AdmissionQueue:
    """The slots and wait queue of one model. Event-loop only (no locks)."""

    def __init__(self, model: str, limits: AdmissionLimits, on_shed: Callable[[str, str], None]) -> None:
        self.model = model
        self.limits = limits
        self._on_shed = on_shed
        self.running = 0  # slots held
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, slots: int) -> Ticket:
        """A ticket for `slots` slots, waiting for them if need be. Raises GatewayError(429)."""
        slots = max(1, min(slots, self.limits.max_running))
        if not self._waiters and self.running + slots <= self.limits.max_running:
            self.running += slots
            return Ticket(self, slots)
        if len(self._waiters) >= self.limits.max_waiting:
            raise self._shed("queue_full", f"the server is at capacity for model {self.model!r} "
                                           f"({self.limits.max_waiting} requests already waiting); retry "
                                           "later")
        entry = (slots, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(entry[1], self.limits.queue_timeout_s)
        except BaseException as exc:
            granted = entry[1].done() and not entry[1].cancelled()
            if granted:  # the slots arrived as the wait ended: hand them on
                self._release(slots)
            else:
                self._waiters.remove(entry)
                self._grant()  # the head may have left: the next one may fit now
            if isinstance(exc, asyncio.TimeoutError):
                raise self._shed("queue_timeout", f"waited {self.limits.queue_timeout_s:g}s for capacity for "
                                                  f"model {self.model!r}; retry later") from None
            raise
        return Ticket(self, slots)

    def _release(self, slots: int) -> None:
        self.running -= slots
        self._grant()

    def _grant(self) -> None:
        while self._waiters:
            slots, future = self._waiters[0]
            if self.running + slots > self.limits.max_running:
                return
            self._waiters.popleft()
            self.running += slots
            future.set_result(None)

    def _shed(self, reason: str, message: str) -> GatewayError:
        self._on_shed(self.model, reason)
        return GatewayError(429, message, code="server_overloaded",
                            headers={"Retry-After": str(self.limits.retry_after_s)})


class AdmissionControl:
    """One AdmissionQueue per model name, made on first use."""

    def __init__(self, limits: AdmissionLimits, on_shed: Callable[[str, str], None]) -> None:
        self.limits = limits
        self._on_shed = on_shed
        self.queues: dict[str, AdmissionQueue] = {}

    def queue(self, model: str) -> AdmissionQueue:
        queue = self.queues.get(model)
        if queue is None:
            queue = self.queues[model] = AdmissionQueue(model, self.limits, self._on_shed)
        return queue


class AdmissionScope(HttpMiddleware):
    """Releases the admission tickets a request took, when its call ends."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        tickets: list[Ticket] = []
        scope[_TICKETS] = tickets
        try:
            await self.app(scope, receive, send)
        finally:
            for ticket in tickets:
                ticket.release()


# -- guards the handlers call -------------------------------------------------------------------

@dataclass
class RequestGuards:
    """Per-gateway limits and the objects that enforce them; one per app (app.state.guards)."""

    encoder: PromptEncoder
    admission: AdmissionControl
    max_generations: int

    def check_fanout(self, prompts: int, per_prompt: int, prompt_param: str, count_param: str) -> int:
        """The number of generations (prompts x per_prompt); 400 above the limit, naming the field
        that asks for more than one per prompt if any (n, best_of), else the prompts' field."""
        total = prompts * per_prompt
        if total > self.max_generations:
            raise bad_request(f"this request asks for {total} generations ({prompts} prompt(s) x "
                              f"{per_prompt}); the limit is {self.max_generations} per request "
                              "(--max-generations-per-request)",
                              param=count_param if per_prompt > 1 else prompt_param,
                              code="too_many_generations")
        return total

    async def admit(self, request: Request, model: str, slots: int) -> bool:
        """Wait for `slots` admission slots, released when the request's ASGI call ends; False if
        the client left while waiting. Raises GatewayError(429) when shed."""
        return bool(await until_disconnected(request, lambda: self._admit(request, model, slots)))

    async def _admit(self, request: Request, model: str, slots: int) -> bool:
        ticket = await self.admission.queue(model).acquire(slots)
        request.scope[_TICKETS].append(ticket)
        return True


def request_guards(request: Request) -> RequestGuards:
    return request.app.state.guards
