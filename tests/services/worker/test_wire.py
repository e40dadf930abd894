"""The worker's wire: protobuf <-> libkv and engine conversion."""

from __future__ import annotations

import pytest

from engine.sampling import SamplingParams
from libkv.layout import KVLayout
from libkv.transfer import TransferEndpoint
from pdserve.sampling_params import StructuredOutput
from protos.v1 import common_pb2
from services.worker.wire import (
    endpoint_from_proto,
    endpoint_to_proto,
    finish_reason_from_proto,
    finish_reason_to_proto,
    layout_from_proto,
    layout_to_proto,
    sampling_from_proto,
    sampling_to_proto,
    token_to_proto,
)


def test_layout_round_trip() -> None:
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, dtype="bfloat16")
    message = layout_to_proto(layout)
    assert (message.num_layers, message.page_size, message.dtype) == (4, 16, "bfloat16")
    assert layout_from_proto(common_pb2.KVLayout.FromString(message.SerializeToString())) == layout


def test_an_mla_layout_and_a_tp_endpoint_of_it_round_trip() -> None:
    layout = KVLayout.mla(num_layers=4, kv_lora_rank=512, qk_rope_head_dim=64, page_size=16, dtype="bfloat16")
    message = layout_to_proto(layout)
    assert (message.kv_lora_rank, message.qk_rope_head_dim, message.num_kv_heads,
            message.head_dim) == (512, 64, 1, 576)
    assert layout_from_proto(common_pb2.KVLayout.FromString(message.SerializeToString())) == layout
    ranks = [TransferEndpoint("nixl", layout, "10.0.0.2", 64, b"rank %d" % rank) for rank in range(2)]
    endpoint = TransferEndpoint.of_ranks(ranks)  # a TP-2 worker: each rank holds the whole latent
    wire = endpoint_from_proto(common_pb2.TransferEndpoint.FromString(
        endpoint_to_proto(endpoint).SerializeToString()))
    assert wire == endpoint and wire.layout == layout and wire.ranks() == ranks
    with pytest.raises(ValueError,
                       match="one head of kv_lora_rank \\+ qk_rope_head_dim = 576 values, got 2 heads"):
        layout_from_proto(common_pb2.KVLayout(num_layers=4, num_kv_heads=2, head_dim=576, page_size=16,
                                              dtype="bfloat16", kv_lora_rank=512, qk_rope_head_dim=64))


def test_missing_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        layout_from_proto(common_pb2.KVLayout())


def test_finish_reasons() -> None:
    for name in ("stop", "length", "abort", None):
        assert finish_reason_from_proto(finish_reason_to_proto(name)) == name
    assert finish_reason_to_proto("length") == common_pb2.FINISH_REASON_LENGTH
    with pytest.raises(ValueError, match="unknown finish reason"):
        finish_reason_to_proto("tired")


def test_token_to_proto() -> None:
    message = token_to_proto(17, "ab", -0.5, [(17, -0.5), (3, -1.25)])
    assert (message.token_id, message.text, message.logprob) == (17, "ab", -0.5)
    assert [(t.token_id, t.logprob) for t in message.top_logprobs] == [(17, -0.5), (3, -1.25)]
    assert token_to_proto(1, "", None, []).logprob == 0.0


def test_endpoint_round_trip() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, page_size=16, dtype="float32")
    endpoint = TransferEndpoint(backend="mooncake", layout=layout, host="10.0.0.2", num_pages=128,
                                blob=b"\x00\xffsession")
    message = endpoint_to_proto(endpoint)
    assert (message.backend, message.descriptor, message.num_pages) == ("mooncake", b"\x00\xffsession", 128)
    wire = common_pb2.TransferEndpoint.FromString(message.SerializeToString())
    assert endpoint_from_proto(wire) == endpoint
    with pytest.raises(ValueError, match="no backend"):
        endpoint_from_proto(common_pb2.TransferEndpoint())


def test_sampling_unset_fields_take_engine_defaults() -> None:
    params = sampling_from_proto(common_pb2.SamplingParams())
    assert params == SamplingParams() and params.validate() is params  # top_k 0 on the wire = off
    greedy = sampling_from_proto(common_pb2.SamplingParams(temperature=0.0, max_new_tokens=5, seed=0))
    assert (greedy.temperature, greedy.max_new_tokens, greedy.seed) == (0.0, 5, 0)


def test_sampling_round_trip() -> None:
    params = SamplingParams(temperature=0.5, top_p=0.75, top_k=40, min_p=0.125, seed=1234,
                            max_new_tokens=64, stop=("\n\n", "END"), stop_token_ids=(7, 9),
                            ignore_eos=True, logprobs=True, top_logprobs=5)
    wire = common_pb2.SamplingParams.FromString(sampling_to_proto(params).SerializeToString())
    assert sampling_from_proto(wire) == params
    off = SamplingParams(top_k=-1)
    assert sampling_from_proto(sampling_to_proto(off)).top_k == -1


def test_out_of_range_sampling_is_left_to_validate() -> None:
    with pytest.raises(ValueError, match="top_p must be in"):
        sampling_from_proto(common_pb2.SamplingParams(top_p=1.5)).validate()
    with pytest.raises(ValueError, match="top_k must be -1"):
        sampling_from_proto(common_pb2.SamplingParams(top_k=-5)).validate()


@pytest.mark.parametrize("structured", [
    StructuredOutput("json_schema", '{"type": "object"}', start_after="</think>", strict=True),
    StructuredOutput("json_object"), StructuredOutput("regex", "[a-z]+"),
    StructuredOutput("ebnf", 'root ::= "yes" | "no"'), StructuredOutput("choice", ("red", "blue")), None])
def test_penalties_biases_and_structured_outputs_round_trip(structured: StructuredOutput | None) -> None:
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.5,
                            logit_bias={7: 5.0, 3: -100.0}, min_tokens=4, structured=structured)
    message = common_pb2.SamplingParams.FromString(sampling_to_proto(params).SerializeToString())
    assert sampling_from_proto(message) == params
    assert params.logit_bias == ((3, -100.0), (7, 5.0))


def test_repetition_penalty_unset_is_off() -> None:
    params = sampling_from_proto(common_pb2.SamplingParams())
    assert (params.repetition_penalty, params.logit_bias, params.structured) == (1.0, (), None)
    assert not params.penalized


@pytest.mark.parametrize(("changes", "message"), [
    ({"presence_penalty": 2.5}, "presence_penalty must be in"),
    ({"frequency_penalty": -3.0}, "frequency_penalty must be in"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ({"logit_bias": {5: 101.0}}, "logit_bias values must be in"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias token ids must be non-negative"),
    ({"min_tokens": -1}, "min_tokens must be at least 0"),
    ({"structured": StructuredOutput("regex", "")}, "regex must be a non-empty string"),
    ({"structured": StructuredOutput("choice", ())}, "choice needs"),
    ({"structured": StructuredOutput("")}, "structured output kind must be one of"),
])
def test_out_of_range_penalties_and_constraints_are_refused(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**changes).validate()


def test_logit_bias_outside_the_vocabulary_is_refused() -> None:
    SamplingParams(logit_bias={99: 1.0}).check_vocab(100)
    with pytest.raises(ValueError, match="below the vocabulary size 100"):
        SamplingParams(logit_bias={100: 1.0}).check_vocab(100)
