"""The OpenAPI document (/openapi.json) made to say what the server does.

FastAPI's generated document declares 422 (the gateway answers 400), no error schema, one media
type for streamed answers, and knows nothing of the served model. Here, once per app:
- every operation declares the error statuses it can answer, each with the OpenAI error schema,
  and no 422; streamed operations declare `text/event-stream` beside JSON;
- with an API key, a bearer security scheme on every operation it guards;
- the request schemas get the bounds the handlers check beyond the pydantic models: the served
  model name, token ids within the vocabulary, token lists and max_tokens within the context, and
  the fan-out limit (prompts x max(n, best_of)) written as an `anyOf` over bands of n, so a body
  the schema allows is a body the server accepts (JSON Schema has no multiplication).
One check stays outside the document: a text prompt's token count (plus max_tokens) must fit the
context; only the tokenizer knows it (400 `context_length_exceeded`).
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from services.gateway.fields import INT32_MAX, INT64_MAX, INT64_MIN, MAX_N
from services.gateway.media_limits import parse_domains
from services.gateway.middleware import OPEN_PATHS, RequestGuards
from services.gateway.state import GatewayState

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_REASONS = {400: "Invalid request (the message and `param` name the field)", 401: "Missing or wrong API key",
            404: "Unknown model or route", 408: "Request body not received in time",
            413: "Request body over the size limit", 429: "Over capacity: retry after `Retry-After` seconds",
            502: "A worker failed", 503: "No healthy worker, or a worker failed", 504: "A worker timed out"}
_GENERATION_ERRORS = (400, 404, 408, 413, 429, 502, 503, 504)
_STREAMED = {"/v1/chat/completions", "/v1/completions", "/generate"}


def install_openapi(app: FastAPI, state: GatewayState, guards: RequestGuards) -> None:
    """Serve the corrected document at /openapi.json (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, description=app.description,
                                   routes=app.routes)
            fix_document(document, state, guards)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def fix_document(document: dict[str, Any], state: GatewayState, guards: RequestGuards) -> None:
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    schemas["ErrorResponse"] = ERROR_SCHEMA
    config = state.config
    guarded = bool(config.api_key)
    if guarded:
        document["components"]["securitySchemes"] = {"bearerAuth": {"type": "http", "scheme": "bearer"}}
    open_paths = OPEN_PATHS | (set() if config.metrics_require_api_key else {"/metrics"})
    for path, operations in document.get("paths", {}).items():
        for method, operation in operations.items():
            _fix_operation(path, method, operation, guarded=guarded and path not in open_paths)
    _bound_requests(schemas, state, guards.max_generations)
    _exact_integer_bounds(schemas)


def _exact_integer_bounds(schema: Any) -> None:
    """FastAPI's document model stores every bound as a float: 2**63 - 1 became 2**63 (a seed the
    server refuses). Integer bounds are written back as integers; the int64 ones exactly."""
    if isinstance(schema, list):
        for item in schema:
            _exact_integer_bounds(item)
    elif isinstance(schema, dict):
        if schema.get("type") == "integer":
            for key in ("minimum", "maximum"):
                value = schema.get(key)
                if isinstance(value, float):
                    schema[key] = (INT64_MAX if value >= 2.0**63 else INT64_MIN if value <= -(2.0**63)
                                   else int(value))
        for item in schema.values():
            _exact_integer_bounds(item)


def _error(status: int) -> dict[str, Any]:
    return {"description": _REASONS.get(status, "Error"),
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


def _fix_operation(path: str, method: str, operation: dict[str, Any], *, guarded: bool) -> None:
    responses = operation.setdefault("responses", {})
    responses.pop("422", None)
    statuses: list[int] = [413]  # any request may announce a body over the limit
    if method == "post":
        statuses += _GENERATION_ERRORS
    if path.startswith("/v1/models/"):
        statuses.append(404)
    if path == "/health":
        statuses.append(503)
    if guarded:
        statuses.append(401)
        operation["security"] = [{"bearerAuth": []}]
    for status in sorted(set(statuses)):
        responses[str(status)] = _error(status)
    if path == "/health":
        responses["503"]["content"]["application/json"]["schema"] = {
            "allOf": [{"$ref": "#/components/schemas/ErrorResponse"},
                      {"type": "object", "properties": {"workers": {"type": "object"}}}]}
        responses["200"]["content"]["application/json"]["schema"] = {
            "type": "object", "required": ["status", "model", "workers"],
            "properties": {"status": {"type": "string"}, "model": {"type": "string"},
                           "workers": {"type": "object", "additionalProperties": {"type": "integer"}}}}
    if path == "/metrics":
        responses["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
    if path in _STREAMED and method == "post":
        # before OpenAPI 3.2 (no itemSchema) `schema` describes one event
        responses["200"]["content"]["text/event-stream"] = {"schema": {
            "type": "object", "required": ["data"], "properties": {"data": {"type": "string"}},
            "description": "one server-sent event: `data: {chunk as JSON}`; the last is `data: [DONE]`"}}


# -- request bounds that depend on the served model and the gateway's limits ----------------------

def _bound_requests(schemas: dict[str, Any], state: GatewayState, max_generations: int) -> None:
    files = state.model_files
    vocab_max = files.vocab_size - 1
    context = files.context_length
    max_new = context - 1 if context is not None else INT32_MAX  # the prompt takes at least one token
    max_prompt = context - 1 if context is not None else None
    max_n = min(MAX_N, max_generations)

    def token_ids(schema: dict[str, Any]) -> None:
        schema["items"]["maximum"] = vocab_max
        if max_prompt is not None:
            schema["maxItems"] = max_prompt

    for name in ("ChatCompletionRequest", "CompletionRequest"):
        properties = schemas[name]["properties"]
        properties["model"]["enum"] = [state.model_name]
        properties["n"]["maximum"] = max_n
        for field in ("max_tokens", "max_completion_tokens"):
            if field in properties:
                _set_in_members(properties[field], "maximum", max_new)
        _bound_stop_token_ids(properties["stop_token_ids"], vocab_max)
        _bound_logit_bias(properties, vocab_max)

    completion = schemas["CompletionRequest"]
    properties = completion["properties"]
    properties["best_of"]["anyOf"][0]["maximum"] = max_n
    for member in _members(properties["prompt"]):
        if member.get("type") == "array" and member["items"].get("type") == "integer":
            token_ids(member)
        elif member.get("type") == "array" and member["items"].get("type") == "array":
            token_ids(member["items"])
    completion["anyOf"] = _fanout_bands(max_generations, max_n)

    native = schemas["NativeGenerateRequest"]
    properties = native["properties"]
    properties["model"]["anyOf"][0]["enum"] = [state.model_name]
    for member in _members(properties["input_ids"]):
        if member.get("type") == "array" and member["items"].get("type") == "integer":
            token_ids(member)
        elif member.get("type") == "array":
            token_ids(member["items"])
            member["maxItems"] = max_generations
    for member in _members(properties["text"]):
        if member.get("type") == "array":
            member["maxItems"] = max_generations
    native["allOf"] = [
        # exactly one of text and input_ids (null counts as absent)
        {"oneOf": [{"required": ["text"], "properties": {"text": {"not": {"type": "null"}}}},
                   {"required": ["input_ids"], "properties": {"input_ids": {"not": {"type": "null"}}}}]},
        # a stream carries one prompt: no batch of texts or of id lists
        {"anyOf": [{"not": {"required": ["stream"]}},
                   {"properties": {"stream": {"const": False}}},
                   {"properties": {"text": {"type": ["string", "null"]},
                                   "input_ids": {"anyOf": [{"type": "null"},
                                                           {"type": "array",
                                                            "items": {"type": "integer"}}]}}}]},
    ]
    structures = ("json_schema", "regex", "ebnf")  # at most one of them (null counts as absent)
    schemas["NativeSamplingParams"]["not"] = {"anyOf": [
        {"required": [a, b], "properties": {a: {"not": {"type": "null"}}, b: {"not": {"type": "null"}}}}
        for i, a in enumerate(structures) for b in structures[i + 1:]]}
    sampling = schemas["NativeSamplingParams"]["properties"]
    _set_in_members(sampling["max_new_tokens"], "maximum", max_new)
    _bound_stop_token_ids(sampling["stop_token_ids"], vocab_max)
    _bound_logit_bias(sampling, vocab_max)
    _content_parts_of_the_model(schemas, multimodal=files.multimodal,
                                allowed_domains=parse_domains(state.config.allowed_media_domains))


def _bound_logit_bias(properties: dict[str, Any], vocab_max: int) -> None:
    if "logit_bias" in properties:  # its keys are token ids, as text
        for member in _members(properties["logit_bias"]):
            if member.get("type") == "object":
                member["propertyNames"] = {"pattern": up_to_pattern(vocab_max)}


def _content_parts_of_the_model(schemas: dict[str, Any], *, multimodal: bool,
                                allowed_domains: tuple[str, ...]) -> None:
    """A text-only model takes text only (an image part or image_data is a 400 there): the document
    lists image parts and /generate's image_data only for a vision-language model, whose image URLs
    are data: URLs or http(s) URLs on the allowed domains (--allowed-media-domains)."""
    if multimodal:
        pattern = r"^data:image/(png|jpeg|webp);base64,"
        if allowed_domains:
            hosts = "|".join(re.escape(host) for host in allowed_domains)
            pattern = rf"^(data:image/(png|jpeg|webp);base64,|https?://({hosts})([:/?#]|$))"
        schemas["ImageURL"]["properties"]["url"]["pattern"] = pattern
        return
    schemas["NativeGenerateRequest"]["properties"].pop("image_data", None)
    for member in _members(schemas["ChatMessage"]["properties"]["content"]):
        if member.get("type") == "array":
            member["items"] = {"$ref": "#/components/schemas/TextPart"}
    for unused in ("ImagePart", "ImageURL"):
        schemas.pop(unused, None)


def up_to_pattern(largest: int) -> str:
    """A regular expression for the decimal integers 0..largest, without leading zeros."""
    digits = str(largest)
    options = ["0"] if largest >= 0 else []
    if len(digits) > 1:
        options.append(f"[1-9][0-9]{{0,{len(digits) - 2}}}")  # the shorter numbers
    for i, d in enumerate(digits):  # same length: equal up to position i, smaller there
        low = 1 if i == 0 else 0
        if int(d) > low:
            options.append(f"{digits[:i]}[{low}-{int(d) - 1}][0-9]{{{len(digits) - i - 1}}}")
    if largest > 0:
        options.append(digits)
    return "^(" + "|".join(options) + ")$"


def _members(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """The alternatives of a union schema (`anyOf`/`oneOf`, nested ones flattened), or the schema."""
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return [leaf for member in schema[key] for leaf in _members(member)]
    return [schema]


def _set_in_members(schema: dict[str, Any], key: str, value: Any) -> None:
    """Set `key` on the non-null members of an optional field's schema."""
    for member in _members(schema):
        if member.get("type") != "null":
            member[key] = value


def _bound_stop_token_ids(schema: dict[str, Any], vocab_max: int) -> None:
    for member in _members(schema):
        if member.get("type") == "array":
            member["items"]["maximum"] = vocab_max


def _fanout_bands(max_generations: int, max_n: int) -> list[dict[str, Any]]:
    """prompts x max(n, best_of) <= max_generations as an anyOf: for each band of per-prompt counts
    c with the same floor(max_generations / c) = q, "n and best_of <= the band's top, and a batch
    prompt holds at most q prompts". A string or a flat id list is one prompt in any band."""
    bands = []
    count = 1
    while count <= max_n:
        most_prompts = max_generations // count
        top = min(max_n, max_generations // most_prompts)  # the last count with the same quotient
        bands.append({"properties": {
            "n": {"maximum": top}, "best_of": {"maximum": top},
            "prompt": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}},
                                 {"type": "array", "maxItems": most_prompts}]}}})
        count = top + 1
    return bands
