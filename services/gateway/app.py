"""The gateway's FastAPI application: routes, error bodies, request metrics, /health, /metrics.

`create_app(state)` wires a GatewayState (state.py) into an app; its lifespan starts registry
discovery and health probes and stops them on shutdown. The OpenAPI document (/openapi.json, /docs)
is FastAPI's, made to match what the server does by openapi.py.

ASGI middleware (middleware.py), outermost first: RequestCounter (counts every answer, refusals
included), InternalErrors (a bug answers 500 and keeps the connection), BodyLimit (413/408 while
the body is read), ApiKeyAuth (401 before any body is read), AdmissionScope (releases admission
slots when a request's call ends). /health reads nothing and waits for nothing, so it stays fast
under load.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from services.gateway import lora_routes, routes
from services.gateway.errors import error_body, install_error_handlers
from services.gateway.images import ImageLoader
from services.gateway.large_bodies import LargeBodies
from services.gateway.media_limits import MediaLimits
from services.gateway.middleware import (
    AdmissionControl,
    AdmissionLimits,
    AdmissionScope,
    ApiKeyAuth,
    BodyLimit,
    InternalErrors,
    RequestCounter,
    RequestGuards,
)
from services.gateway.openapi import install_openapi
from services.gateway.prompts import PromptEncoder
from services.gateway.state import GatewayState


def make_guards(state: GatewayState) -> RequestGuards:
    config = state.config
    admission = AdmissionControl(
        AdmissionLimits(max_running=config.max_concurrent_requests, max_waiting=config.queue_size,
                        queue_timeout_s=config.queue_timeout, retry_after_s=config.retry_after),
        on_shed=lambda model, reason: state.metrics.shed.labels(model=model, reason=reason).inc())
    state.metrics.watch_admission(admission)
    return RequestGuards(encoder=PromptEncoder(state.model_files, config.tokenizer_threads),
                         admission=admission, max_generations=config.max_generations_per_request)


def create_app(state: GatewayState) -> FastAPI:
    guards = make_guards(state)
    images = ImageLoader(MediaLimits.of(state.config))
    large_bodies = LargeBodies(state.config.body_parse_processes)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.close()
            guards.encoder.close()
            await images.close()
            large_bodies.close()

    app = FastAPI(title="pdserve gateway", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API in front of pdserve prefill/decode workers")
    app.state.gateway = state
    app.state.guards = guards
    app.state.images = images
    app.state.large_bodies = large_bodies
    install_error_handlers(app)
    app.include_router(routes.router)
    # listed in the OpenAPI document only where served (off: they answer 404 saying how to turn them on)
    app.include_router(lora_routes.router, include_in_schema=state.config.enable_lora)

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

    config = state.config
    app.add_middleware(AdmissionScope)
    if config.api_key:
        app.add_middleware(ApiKeyAuth, api_key=config.api_key,
                           metrics_require_api_key=config.metrics_require_api_key)
    # a vision-language model's requests carry images as base64: room for them over the text limit
    image_room = images.limits.body_bytes() if state.model_files.multimodal else 0
    app.add_middleware(BodyLimit, max_bytes=config.max_request_body_bytes + image_room,
                       read_timeout_s=config.body_read_timeout,
                       flags="--max-request-body-bytes"
                       + (" + --max-request-image-bytes as base64" if image_room else ""))
    app.add_middleware(InternalErrors)
    app.add_middleware(RequestCounter, metrics=state.metrics)
    install_openapi(app, state, guards)
    return app
