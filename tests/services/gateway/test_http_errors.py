"""Bad requests get OpenAI error bodies with the right status (never 500), in-process over ASGI.

No worker is registered, so a valid request ends in 503 "no healthy workers": that is also the
proof that validation let it through.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from services.gateway.state import build_state

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
TEXT = {"model": "tiny", "prompt": "hi"}


@pytest.fixture
async def client(tiny_model: Path) -> AsyncIterator[httpx.AsyncClient]:
    state = build_state(GatewayConfig(model_path=str(tiny_model)))
    transport = httpx.ASGITransport(app=create_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        yield http
    state.pool.close()


def assert_error(response: httpx.Response, status: int, *, param: str | None = "any",
                 code: str | None = "any", contains: str = "") -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} or (status == 503 and "error" in body)
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param != "any":
        assert error["param"] == param
    if code != "any":
        assert error["code"] == code
    assert contains in error["message"]
    return error


@pytest.mark.parametrize("path, body, param, contains", [
    ("/v1/chat/completions", {**CHAT, "temperature": 2.5}, "temperature", "less than or equal to 2"),
    ("/v1/chat/completions", {**CHAT, "top_p": 0}, "top_p", "greater than 0"),
    ("/v1/chat/completions", {**CHAT, "n": 0}, "n", "greater than or equal to 1"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -3}, "max_completion_tokens", ""),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 21, "logprobs": True}, "top_logprobs", ""),
    ("/v1/chat/completions", {**CHAT, "min_p": 1.5}, "min_p", ""),
    ("/v1/chat/completions", {**CHAT, "top_k": -2}, "top_k", "greater than or equal to -1"),
    ("/v1/chat/completions", {**CHAT, "stop": ["ok", ""]}, "stop", "at least 1 character"),
    ("/v1/chat/completions", {**CHAT, "presence_penalty": 2.5}, "presence_penalty", "less than or equal"),
    ("/v1/chat/completions", {**CHAT, "frequency_penalty": -3}, "frequency_penalty", "greater than or"),
    ("/v1/chat/completions", {**CHAT, "repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": 100.5}}, "logit_bias", "must be in [-100, 100]"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs", "exactly one of"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, "response_format",
     "needs a json_schema"),
    ("/v1/chat/completions", {"model": "tiny"}, "messages", "Field required"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages", "at least 1"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "input_audio", "text": "x"}]}]}, "messages.0.content",
     "tag 'input_audio' found using 'type' does not match any of the expected tags: 'text', 'image_url'"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages",
     "images sent to a text-only model"),
    ("/v1/chat/completions", {**CHAT, "model": None}, "model", ""),
    ("/v1/completions", {**TEXT, "logprobs": 21}, "logprobs", ""),
    ("/v1/completions", {**TEXT, "echo": True}, None, "echo is not supported"),
    ("/v1/completions", {**TEXT, "prompt": []}, "prompt", "non-empty string, list of strings"),
    ("/v1/completions", {**TEXT, "prompt": ""}, "prompt", "at least 1 character"),
    ("/v1/completions", {**TEXT, "prompt": [[1], []]}, "prompt", "at least 1 item"),
    ("/v1/completions", {**TEXT, "n": "2"}, "n", "valid integer"),
    ("/v1/completions", {**TEXT, "stream": 1}, "stream", "valid boolean"),
    ("/v1/completions", {**TEXT, "best_of": 0}, "best_of", "greater than or equal to 1"),
    ("/v1/completions", {**TEXT, "max_tokens": 4096}, "max_tokens", "maximum context length is 4096"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 4096, "max_completion_tokens": 5}, "max_tokens", "4096"),
    ("/v1/completions", {**TEXT, "stop_token_ids": [4096]}, "stop_token_ids", "outside the vocabulary"),
    ("/v1/completions", {**TEXT, "prompt": ["a"] * 257}, "prompt", "257 generations"),
    ("/v1/completions", {**TEXT, "prompt": ["a"] * 3, "best_of": 100}, "best_of", "300 generations"),
    ("/generate", {"text": "hi", "rid": "no spaces please"}, "rid", "pattern"),
    ("/v1/completions", {**TEXT, "prompt": [1, 99999]}, "prompt", "outside the vocabulary"),
    ("/v1/completions", {**TEXT, "prompt": {"text": "x"}}, "prompt", ""),
    ("/generate", {"text": "hi", "input_ids": [1, 2]}, None, "exactly one of text or input_ids"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 0}},
     "sampling_params.max_new_tokens", ""),
    ("/generate", {"text": ["a", "b"], "stream": True}, "stream", "one prompt at a time"),
    ("/generate", {"text": "hi", "sampling_params": {"logit_bias": {"5": -100.5}}},
     "sampling_params.logit_bias", "must be in [-100, 100]"),
])
async def test_invalid_requests_are_400(client: httpx.AsyncClient, path: str, body: dict, param: str | None,
                                        contains: str) -> None:
    error = assert_error(await client.post(path, json=body), 400, contains=contains)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


async def test_malformed_json_is_400(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", content=b'{"model": "tiny", "messages": [',
                                 headers={"content-type": "application/json"})
    assert_error(response, 400, contains="malformed JSON")
    assert_error(await client.post("/v1/completions", content=b"not json at all"), 400)


async def test_unknown_model_is_404(client: httpx.AsyncClient) -> None:
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", TEXT),
                       ("/generate", {"text": "x", "model": "tiny"})):
        error = assert_error(await client.post(path, json={**body, "model": "gpt-4o"}), 404,
                             param="model", code="model_not_found", contains="`gpt-4o` does not exist")
        assert error["type"] == "not_found_error"
    assert_error(await client.get("/v1/models/gpt-4o"), 404, code="model_not_found")
    assert_error(await client.get("/v1/nothing-here"), 404, contains="no route GET /v1/nothing-here")


async def test_prompt_longer_than_context_names_both_lengths(client: httpx.AsyncClient) -> None:
    long_prompt = [5] * 5000
    error = assert_error(await client.post("/v1/completions", json={**TEXT, "prompt": long_prompt}), 400,
                         code="context_length_exceeded", param="prompt")
    assert "4096" in error["message"] and "5000" in error["message"]
    error = assert_error(await client.post("/v1/completions",
                                           json={**TEXT, "prompt": [5] * 4000, "max_tokens": 200}),
                         400, code="context_length_exceeded", param="max_tokens")
    assert all(part in error["message"] for part in ("4096", "4200", "4000 in the prompt"))
    chat = {**CHAT, "messages": [{"role": "user", "content": "hello " * 5000}]}
    error = assert_error(await client.post("/v1/chat/completions", json=chat), 400,
                         code="context_length_exceeded")
    assert "4096" in error["message"]


async def test_valid_requests_without_workers_are_503(client: httpx.AsyncClient) -> None:
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {**TEXT, "n": 2}),
                       ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}),  # ignored without logprobs
                       ("/v1/completions", {**TEXT, "n": 2.0, "best_of": 1, "max_tokens": 4000}),
                       ("/v1/chat/completions", {**CHAT, "stream": True}),
                       ("/generate", {"input_ids": [1, 2]})):
        assert_error(await client.post(path, json=body), 503, code="no_healthy_workers", contains="tiny")
    assert_error(await client.get("/health"), 503)


async def test_models_openapi_and_metrics(client: httpx.AsyncClient) -> None:
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in models["data"]] == [("tiny", "model", 4096)]
    assert (await client.get("/v1/models/tiny")).json()["id"] == "tiny"
    spec = (await client.get("/openapi.json")).json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/generate"} <= set(spec["paths"])
    await client.post("/v1/chat/completions", json={**CHAT, "n": 0})
    text = (await client.get("/metrics")).text
    assert 'pdserve:gateway_requests_total{endpoint="/v1/chat/completions",status="400"} 1.0' in text
    assert "pdserve:gateway_time_to_first_token_seconds_bucket" in text
