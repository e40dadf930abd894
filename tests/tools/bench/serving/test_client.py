"""The benchmark client's two endpoints: the bodies it sends (read back by the gateway's own request
models), the tokens it counts in stream chunks written by the gateway's own response models, and
text prompts of the length asked for."""

from __future__ import annotations

import json
import random

import pytest

from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.responses import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    Usage,
    event,
)
from tools.bench.serving import datasets
from tools.bench.serving.client import ENDPOINTS
from tools.bench.serving.datasets import Prompt
from tools.bench.serving.main import warmup_prompts
from tools.bench.serving.workload import RequestClass

CHAT = ENDPOINTS["chat"]
COMPLETIONS = ENDPOINTS["completions"]


def test_the_completions_body_is_unchanged() -> None:
    body = COMPLETIONS.body("m", Prompt("c", [5, 6, 7], 3, 9), ignore_eos=True, logprobs=True)
    assert COMPLETIONS.path == "/v1/completions"
    assert body == {"model": "m", "prompt": [5, 6, 7], "max_tokens": 9, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True, "logprobs": 0}
    assert "logprobs" not in COMPLETIONS.body("m", Prompt("c", [5], 1, 2), ignore_eos=False, logprobs=False)
    parsed = CompletionRequest.model_validate(body)
    assert parsed.ignore_eos and parsed.logprobs == 0 and parsed.max_tokens == 9


def test_the_chat_body_is_one_user_message_the_gateway_reads_as_sent() -> None:
    body = CHAT.body("m", Prompt("c", "hello there", 2, 9), ignore_eos=True, logprobs=True)
    assert CHAT.path == "/v1/chat/completions"
    assert body == {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 9,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                    "ignore_eos": True, "logprobs": True}
    parsed = ChatCompletionRequest.model_validate(body)
    assert parsed.ignore_eos and parsed.logprobs and parsed.include_usage and parsed.max_new_tokens == 9
    assert parsed.temperature == 0 and parsed.stream
    assert "logprobs" not in CHAT.body("m", Prompt("c", "hi", 1, 2), ignore_eos=False, logprobs=False)


def test_a_chat_body_refuses_token_ids() -> None:
    with pytest.raises(ValueError, match="needs the prompt as text"):
        CHAT.body("m", Prompt("c", [1, 2], 2, 4), ignore_eos=True, logprobs=True)


def _chunk(delta: ChatDelta, tokens: int | None = None, finish_reason: str | None = None) -> dict:
    """One chat stream chunk as the gateway writes it (services/gateway/routes.py), read back."""
    logprobs = (ChatLogprobs(content=[ChatTokenLogprob(token=f"t{i}", logprob=-0.5) for i in range(tokens)])
                if tokens is not None else None)
    text = event(ChatCompletionChunk(id="chatcmpl-1", created=0, model="m", choices=[
        ChatChunkChoice(index=0, delta=delta, logprobs=logprobs, finish_reason=finish_reason)]))
    assert text.startswith("data: ") and text.endswith("\n\n")
    return json.loads(text.removeprefix("data: "))


def test_chat_chunks_count_the_tokens_their_logprobs_list() -> None:
    first = _chunk(ChatDelta(role="assistant", content=""))  # the role chunk carries no token
    assert CHAT.tokens_in(first["choices"][0]) == 0
    assert CHAT.tokens_in(_chunk(ChatDelta(content="ab"), tokens=1)["choices"][0]) == 1
    # a chunk carrying three tokens (the detokenizer held text back, or one network read)
    assert CHAT.tokens_in(_chunk(ChatDelta(content="abc d"), tokens=3)["choices"][0]) == 3
    # tokens whose text is still held back: no content, but logprobs say they came
    assert CHAT.tokens_in(_chunk(ChatDelta(), tokens=2)["choices"][0]) == 2
    assert CHAT.tokens_in(_chunk(ChatDelta(), tokens=1, finish_reason="length")["choices"][0]) == 1


def test_chat_chunks_without_logprobs_count_one_token_per_chunk_with_text() -> None:
    assert CHAT.tokens_in(_chunk(ChatDelta(content="abc"))["choices"][0]) == 1
    assert CHAT.tokens_in(_chunk(ChatDelta(), finish_reason="length")["choices"][0]) == 0
    usage = json.loads(event(ChatCompletionChunk(id="c", created=0, model="m", choices=[],
                                                 usage=Usage.of(7, 4))).removeprefix("data: "))
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 7


def test_completion_chunks_still_count_their_logprob_tokens() -> None:
    assert COMPLETIONS.tokens_in({"text": "ab", "logprobs": {"tokens": ["a", "b"]}}) == 2
    assert COMPLETIONS.tokens_in({"text": "ab"}) == 1
    assert COMPLETIONS.tokens_in({"text": ""}) == 0


def test_random_text_prompts_encode_to_the_length_asked(qwen3_ckpt) -> None:
    tokenizer = datasets.load_tokenizer(qwen3_ckpt)
    load = RequestClass("u", 64, 8, 6, concurrency=2)
    prompts = datasets.random_prompts(load, tokenizer, random.Random(3), as_text=True)
    assert [p.input_len for p in prompts] == [64] * 6 and all(isinstance(p.prompt, str) for p in prompts)
    lengths = [len(tokenizer.encode(p.prompt, add_special_tokens=False).ids) for p in prompts]
    assert all(abs(length - 64) <= 2 for length in lengths), lengths
    # token-id prompts are drawn as before: the same ids for the same seed
    ids = datasets.random_prompts(load, tokenizer, random.Random(3))
    assert all(isinstance(p.prompt, list) and len(p.prompt) == 64 for p in ids)


def test_warmup_prompts_are_other_prompts_of_the_same_lengths(qwen3_ckpt) -> None:
    tokenizer = datasets.load_tokenizer(qwen3_ckpt)
    measured = datasets.random_prompts(RequestClass("u", 40, 8, 5, concurrency=2, range_ratio=0.5), tokenizer,
                                       random.Random(1))
    warmup = warmup_prompts(measured, 3, tokenizer, seed=1, as_text=False)
    assert [p.input_len for p in warmup] == [p.input_len for p in measured[:3]]
    assert all(p.output_len == 4 for p in warmup)
    assert not {tuple(p.prompt) for p in warmup} & {tuple(p.prompt) for p in measured}
    assert warmup_prompts(measured, 0, tokenizer, seed=1, as_text=False) == []
