"""The gateway's FastAPI application: routes, error bodies, request metrics, /health, /metrics.

`create_app(state)` wires a GatewayState (state.py) into an app; its lifespan starts registry
discovery and health probes and stops them on shutdown. The OpenAPI document is FastAPI's
(/openapi.json, /docs).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway import routes_native, routes_openai
from services.gateway.errors import error_body, install_error_handlers
from services.gateway.metrics import GatewayMetrics
from services.gateway.state import GatewayState

_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/generate", "/health", "/metrics")


class RequestCounter:
    """Pure ASGI middleware counting responses by endpoint and status (a BaseHTTPMiddleware would
    buffer streams and hide client disconnects from the handlers)."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in _ENDPOINTS else ("/v1/models" if path.startswith("/v1/models/") else "other")
        status = {"code": 500}

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                self.metrics.requests.labels(endpoint=endpoint, status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def create_app(state: GatewayState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.close()

    app = FastAPI(title="pdserve gateway", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API in front of pdserve prefill/decode workers")
    app.state.gateway = state
    install_error_handlers(app)
    app.include_router(routes_openai.router)
    app.include_router(routes_native.router)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 when the gateway can serve the model now, else 503 (a readiness check): see
        GatewayState.readiness."""
        workers = {role: 0 for role in ("prefill", "decode", "colocated")}
        for worker in state.pool.all():
            workers[worker.role] = workers.get(worker.role, 0) + 1
        not_ready = state.readiness()
        if not_ready is not None:
            body = error_body(503, not_ready, code="no_healthy_workers")
            return JSONResponse({**body, "workers": workers}, status_code=503)
        return JSONResponse({"status": "ok", "model": state.model_name, "workers": workers})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(RequestCounter, metrics=state.metrics)
    return app
