"""API key check: OpenAI bearer tokens (`Authorization: Bearer KEY`) on every route but a few open ones.

Pure ASGI middleware, so it runs before any route reads the body and covers every path, unknown
ones included (a client without the key cannot even learn which routes exist). `/health` stays
open for load balancers and orchestrators; `/metrics` is open unless `--metrics-require-api-key`;
the OpenAPI document and its viewers are open (they describe the API, they do not use it). The key
is compared in constant time, as SHA-256 digests so that not even its length shows in the timing.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from services.gateway.body_limit import declared_length
from services.gateway.errors import error_response

OPEN_PATHS = frozenset({"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


def bearer_token(scope: Scope) -> bytes | None:
    """The token of an `Authorization: Bearer TOKEN` header (scheme case-insensitive), else None."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


class ApiKeyAuth:
    """401 with an OpenAI error body unless the request carries the key (see module docstring)."""

    def __init__(self, app: ASGIApp, api_key: str, metrics_require_api_key: bool) -> None:
        self.app = app
        self._key_digest = hashlib.sha256(api_key.encode("utf-8")).digest()
        self._open = OPEN_PATHS if metrics_require_api_key else OPEN_PATHS | {"/metrics"}

    def allows(self, scope: Scope) -> bool:
        if scope.get("path") in self._open:
            return True
        token = bearer_token(scope)
        return token is not None and hmac.compare_digest(hashlib.sha256(token).digest(), self._key_digest)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.allows(scope):
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
