"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status.

Client mistakes are 4xx, never 500: FastAPI's 422 for a body that fails validation becomes 400,
malformed JSON is 400, an unknown route 404. Worker-side gRPC statuses map through
`status_for_grpc`: INVALID_ARGUMENT (the worker rejected the request) is the client's 400; a prefill
and a decode that refuse each other (FAILED_PRECONDITION) a named 503; only an unknown status is a 500.

Error bodies are encoded so that nothing a client sent can break them (a lone surrogate in a
message becomes "?"). A gateway bug answers 500 without dropping the keep-alive connection
(middleware.InternalErrors).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Message, Send

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable_error", 504: "timeout_error"}


@dataclass
class GatewayError(Exception):
    """An error answered to the client as an OpenAI error body."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    type: str | None = None
    headers: dict[str, str] | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code, type_=self.type)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None,
               type_: str | None = None) -> dict[str, Any]:
    error_type = type_ or _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


class ErrorResponse(JSONResponse):
    """A JSON error body that always encodes: strings the client sent may hold lone surrogates."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace")


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   type_: str | None = None, headers: dict[str, str] | None = None) -> ErrorResponse:
    return ErrorResponse(error_body(status, message, param=param, code=code, type_=type_), status_code=status,
                         headers=headers)


async def send_error(send: Send, exc: StarletteHTTPException) -> None:
    """Answer an HTTPException straight from ASGI middleware (outside FastAPI's handlers)."""
    response = error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))
    await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:  # a Response never reads the request
    raise RuntimeError("not used")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


# Worker gRPC status -> (HTTP status, error code) once retries are exhausted or not allowed.
_GRPC_TO_HTTP: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_argument"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_argument"),
    grpc.StatusCode.NOT_FOUND: (404, "model_not_found"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (503, "overloaded"),
    grpc.StatusCode.UNAVAILABLE: (503, "worker_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.CANCELLED: (503, "cancelled"),
    # A prefill and a decode that disagree (KV layout, transfer backend, draft config, adapter files):
    # the deployment's fault, not the client's, and the details name the field.
    grpc.StatusCode.FAILED_PRECONDITION: (503, "workers_disagree"),
}


def status_for_grpc(code: grpc.StatusCode) -> tuple[int, str]:
    return _GRPC_TO_HTTP.get(code, (500, "worker_error"))


def _location(loc: tuple[Any, ...]) -> str | None:
    """The field a validation error names: its path without "body", cut at a tagged union's tag
    (protocol.py's prompt forms): `prompt`, not `prompt.form:ids.3`."""
    parts = []
    for part in loc:
        if isinstance(part, str) and part.startswith("form:"):
            break
        if part != "body":
            parts.append(str(part))
    return ".".join(parts) or None


def _common_prefix(locations: list[tuple[Any, ...]]) -> tuple[Any, ...]:
    prefix = list(locations[0])
    for location in locations[1:]:
        same = 0
        while same < min(len(prefix), len(location)) and prefix[same] == location[same]:
            same += 1
        del prefix[same:]
    return tuple(prefix)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    # A value failing every member of a union (prompt: str | list[str] | ...) gives one error per
    # member, located under the member's type name: the parameter is their common location.
    first_location = tuple(first.get("loc", ()))
    same_field = [e for e in errors if tuple(e.get("loc", ()))[:2] == first_location[:2]]
    param = _location(_common_prefix([tuple(e.get("loc", ())) for e in same_field]))
    # Of a union's errors, the one from the member of the right type says what is wrong ("at least
    # 1 character"); the others only say the value is not of their type.
    telling = next((e for e in same_field if not str(e.get("type", "")).endswith("_type")), first)
    message = telling.get("msg", "invalid value")
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    return (f"{param}: {message}" if param else message), param


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error from `app` as an OpenAI error body."""

    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        return ErrorResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

