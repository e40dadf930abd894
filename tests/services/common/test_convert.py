"""Protobuf <-> libkv/engine conversion."""

from __future__ import annotations

import pytest

from libkv.layout import KVLayout
from protos.v1 import common_pb2
from services.common.convert import (
    finish_reason_from_proto,
    finish_reason_to_proto,
    layout_from_proto,
    layout_to_proto,
    token_to_proto,
)


def test_layout_round_trip() -> None:
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, dtype="bfloat16")
    message = layout_to_proto(layout)
    assert (message.num_layers, message.page_size, message.dtype) == (4, 16, "bfloat16")
    assert layout_from_proto(common_pb2.KVLayout.FromString(message.SerializeToString())) == layout


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
