"""The OpenAPI document says what the server does: statuses, error schema, bounds, fan-out."""

from __future__ import annotations

from pathlib import Path

import jsonschema_rs
import pytest

from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from services.gateway.openapi import _fanout_bands
from services.gateway.state import build_state


@pytest.fixture(scope="module")
def document(tiny_model: Path) -> dict:
    return create_app(build_state(GatewayConfig(model_path=str(tiny_model), api_key="k"))).openapi()


def test_no_422_and_every_error_has_the_error_schema(document: dict) -> None:
    assert "HTTPValidationError" not in document["components"]["schemas"]
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "422" not in responses, (path, method)
            assert "413" in responses
            if method == "post":
                assert {"400", "401", "404", "413", "429", "503"} <= set(responses), (path, responses.keys())
            for status, response in responses.items():
                if status != "200" and not (path == "/health" and status == "503"):
                    assert response["content"]["application/json"]["schema"] == {
                        "$ref": "#/components/schemas/ErrorResponse"}
    assert "text/event-stream" in document["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert "security" not in document["paths"]["/health"]["get"]
    assert "security" not in document["paths"]["/metrics"]["get"]  # open unless --metrics-require-api-key


def test_bounds_come_from_the_model_and_the_protobuf_fields(document: dict) -> None:
    schemas = document["components"]["schemas"]
    completion = schemas["CompletionRequest"]["properties"]
    assert completion["model"]["enum"] == ["tiny"]
    assert completion["max_tokens"]["anyOf"][0]["maximum"] == 4095  # context 4096, prompt >= 1 token
    assert completion["seed"]["anyOf"][0] == {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}
    assert completion["top_k"]["anyOf"][0]["maximum"] == 2**31 - 1
    assert completion["stop_token_ids"]["anyOf"][0]["items"]["maximum"] == 4095  # the vocabulary
    ids = next(m for m in completion["prompt"]["oneOf"] if m.get("items", {}).get("type") == "integer")
    assert ids["maxItems"] == 4095 and ids["items"]["maximum"] == 4095 and ids["minItems"] == 1
    assert (completion["presence_penalty"]["minimum"], completion["presence_penalty"]["maximum"]) == (-2, 2)
    assert completion["echo"]["enum"] == [False]


def test_native_sampling_params_say_at_most_one_structure(document: dict) -> None:
    """The server refuses two of json_schema, regex and ebnf (constraints.NativeConstraints); the
    document says so, or a schema-driven client (schemathesis found one) sends them as valid."""
    schema = document["components"]["schemas"]["NativeSamplingParams"]
    validator = jsonschema_rs.validator_for(schema)
    for body in ({}, {"regex": "a+"}, {"ebnf": "root ::= x", "regex": None}, {"json_schema": "{}"}):
        assert validator.is_valid(body), body
    for body in ({"regex": "a+", "ebnf": "root ::= x"}, {"json_schema": "{}", "regex": "a"},
                 {"json_schema": "{}", "ebnf": "e", "regex": None}):
        assert not validator.is_valid(body), body


@pytest.mark.parametrize("limit, max_n", [(256, 128), (100, 100), (7, 7), (1000, 128)])
def test_fanout_bands_accept_exactly_the_bodies_within_the_limit(limit: int, max_n: int) -> None:
    validator = jsonschema_rs.validator_for({"anyOf": _fanout_bands(limit, max_n)})
    for n in range(1, max_n + 1):
        q = limit // n
        counts = range(1, limit + 2) if limit <= 256 else {1, 2, q - 1, q, q + 1, q + 2} - {0, -1}
        for prompts in counts:
            body = {"n": n, "prompt": ["x"] * prompts}
            assert validator.is_valid(body) == (prompts * n <= limit), (n, prompts)
            with_best_of = {"n": 1, "best_of": n, "prompt": ["x"] * prompts}
            assert validator.is_valid(with_best_of) == (prompts * n <= limit), (n, prompts)
        # one prompt (a string or a flat id list) never counts its ids
        assert validator.is_valid({"n": n, "prompt": list(range(limit + 5))})
        assert validator.is_valid({"n": n, "prompt": "x"})


def test_images_are_documented_for_a_vision_language_model_only(document: dict, tmp_path: Path) -> None:
    from tools.models.tiny_model import write_tiny_model

    assert "image_data" not in document["components"]["schemas"]["NativeGenerateRequest"]["properties"]
    assert "ImageURL" not in document["components"]["schemas"]
    vl_model = write_tiny_model(tmp_path / "tiny-vl", preset="tiny-vl", seed=0)
    vl = create_app(build_state(GatewayConfig(model_path=str(vl_model),
                                              allowed_media_domains="a.com,b.example"))
                    ).openapi()["components"]["schemas"]
    assert "image_data" in vl["NativeGenerateRequest"]["properties"]
    url = jsonschema_rs.validator_for(vl["ImageURL"]["properties"]["url"])
    for good in ("data:image/png;base64,AAAA", "https://a.com/cat.png", "http://b.example:8080/x",
                 "https://a.com"):
        assert url.is_valid(good), good
    for bad in ("https://a.com.evil/x", "https://evil.com/a.com", "ftp://a.com/x", "data:text/plain;base64,"):
        assert not url.is_valid(bad), bad
