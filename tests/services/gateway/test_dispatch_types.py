"""The typed pieces around Worker.Generate: request body -> sampling proto, proto chunk -> GenerationChunk."""

from __future__ import annotations

import pytest

from protos.v1 import common_pb2, worker_pb2
from services.gateway.dispatcher import GeneratedToken, chunk_from_proto
from services.gateway.protocol import ChatCompletionRequest, NativeGenerateRequest, NativeSamplingParams

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_unset_sampling_fields_stay_unset_in_the_proto() -> None:
    params = NativeGenerateRequest(text="hi").sampling()
    assert not params.HasField("temperature") and not params.HasField("top_p")
    assert not params.HasField("seed") and not params.HasField("max_new_tokens")
    explicit = NativeGenerateRequest(text="hi", top_logprobs_num=2, sampling_params=NativeSamplingParams(
        temperature=0.0, top_p=0.5, top_k=-1, min_p=None, seed=3, max_new_tokens=7, stop=["\n"],
        stop_token_ids=[2], ignore_eos=True)).sampling()
    assert explicit.HasField("temperature") and explicit.temperature == 0.0
    assert (explicit.top_p, explicit.top_k, explicit.min_p, explicit.seed,
            explicit.max_new_tokens) == (0.5, 0, 0, 3, 7)
    assert list(explicit.stop) == ["\n"] and list(explicit.stop_token_ids) == [2] and explicit.ignore_eos
    assert explicit.logprobs and explicit.top_logprobs == 2  # top logprobs imply logprobs


def test_generate_sampling_params_carry_sglang_constraints() -> None:
    params = NativeSamplingParams.model_validate({"logit_bias": {"7": -100, "12": 2.5}, "min_new_tokens": 3,
                                                  "repetition_penalty": 1.2, "regex": "[a-z]+"})
    sampling = NativeGenerateRequest(text="hi", sampling_params=params).sampling()
    assert dict(sampling.logit_bias) == {7: -100.0, 12: 2.5} and sampling.min_tokens == 3
    assert abs(sampling.repetition_penalty - 1.2) < 1e-6 and sampling.structured.regex == "[a-z]+"


def test_choices_get_distinct_seeds() -> None:
    seeded = ChatCompletionRequest.model_validate({**CHAT, "seed": 10})
    assert [seeded.sampling(i).seed for i in range(3)] == [10, 11, 12]
    assert not ChatCompletionRequest.model_validate(CHAT).sampling(2).HasField("seed")


def test_chunk_from_proto() -> None:
    response = worker_pb2.GenerateResponse(
        outputs=[common_pb2.TokenOutput(token_id=5, text="he", logprob=-0.5,
                                        top_logprobs=[common_pb2.TokenLogprob(token_id=5, logprob=-0.5)]),
                 common_pb2.TokenOutput(token_id=6, text="llo", logprob=-1.0)],
        finish_reason=common_pb2.FINISH_REASON_LENGTH,
        usage=worker_pb2.Usage(prompt_tokens=3, completion_tokens=2))
    chunk = chunk_from_proto(response, want_logprobs=True)
    assert chunk.tokens == (GeneratedToken(5, "he", -0.5, ((5, -0.5),)), GeneratedToken(6, "llo", -1.0, ()))
    assert (chunk.text, chunk.finish_reason, chunk.prompt_tokens,
            chunk.completion_tokens) == ("hello", "length", 3, 2)
    middle = chunk_from_proto(
        worker_pb2.GenerateResponse(outputs=[common_pb2.TokenOutput(token_id=1, text="x")]),
        want_logprobs=False)
    assert middle.finish_reason is None and middle.tokens[0].logprob is None


def test_chunk_from_the_token_columns() -> None:
    """A message without logprobs carries its tokens as two columns; the chunk reads them without a
    message object per token, and builds its GeneratedTokens only when asked."""
    response = worker_pb2.GenerateResponse(token_ids=[5, 6, 7], token_texts=["he", "llo", ""],
                                           finish_reason=common_pb2.FINISH_REASON_STOP,
                                           usage=worker_pb2.Usage(prompt_tokens=4, completion_tokens=3))
    chunk = chunk_from_proto(response, want_logprobs=False)
    assert (tuple(chunk.token_ids), chunk.text, chunk.finish_reason, len(chunk)) == \
        ((5, 6, 7), "hello", "stop", 3)
    assert chunk.tokens == (GeneratedToken(5, "he"), GeneratedToken(6, "llo"), GeneratedToken(7, ""))


def test_columns_of_different_lengths_are_refused() -> None:
    """A worker (or a forged peer) whose columns disagree: no guessing which text belongs to which id."""
    with pytest.raises(ValueError, match="3 token ids and 2 texts"):
        chunk_from_proto(worker_pb2.GenerateResponse(token_ids=[1, 2, 3], token_texts=["a", "b"]), False)
