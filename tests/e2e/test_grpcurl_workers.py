"""Every worker service is listable, describable and callable with grpcurl (reflection, no .proto files)."""

from __future__ import annotations

import json

import pytest

from tests.e2e.cluster import Cluster, worker_args
from tests.grpcurl import grpcurl

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

HEALTH = "grpc.health.v1.Health"
REFLECTION = "grpc.reflection.v1alpha.ServerReflection"


def stream_messages(stdout: str) -> list[dict]:
    """grpcurl prints a server stream as consecutive pretty-printed JSON objects."""
    decoder, messages, index = json.JSONDecoder(), [], 0
    text = stdout.strip()
    while index < len(text):
        message, end = decoder.raw_decode(text, index)
        messages.append(message)
        index = end
        while index < len(text) and text[index].isspace():
            index += 1
    return messages


def stream_tokens(messages: list[dict]) -> list[int]:
    return [o["token_id"] for m in messages for o in m.get("outputs", [])]


def test_grpcurl_lists_describes_and_calls_every_worker(cluster: Cluster, tiny_model):
    bootstrap = cluster.bootstrap()
    colocated, prefill, decode = cluster.start_many([
        ("colocated", worker_args(tiny_model, "null", bootstrap=bootstrap)),
        ("prefill", worker_args(tiny_model, "prefill", backend="mooncake", bootstrap=bootstrap)),
        ("decode", worker_args(tiny_model, "decode", backend="mooncake", bootstrap=bootstrap)),
    ])
    for proc, service in ((colocated, "pdserve.v1.Worker"), (decode, "pdserve.v1.Worker"),
                          (prefill, "pdserve.v1.Prefill")):
        listed = grpcurl(proc.address, "list")
        assert listed.returncode == 0, listed.stderr
        assert set(listed.stdout.split()) == {service, "pdserve.v1.KvEvents", HEALTH, REFLECTION}
        described = grpcurl(proc.address, "describe", service)
        assert described.returncode == 0, described.stderr
        assert "rpc Abort" in described.stdout
        health = grpcurl(proc.address, HEALTH + "/Check", body={"service": service})
        assert json.loads(health.stdout)["status"] == "SERVING"

    body = {"room": "grpcurl-1", "prompt_token_ids": [11, 12, 13, 14, 15],
            "sampling": {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}}
    colocated_call = grpcurl(colocated.address, "pdserve.v1.Worker/Generate", body=body)
    assert colocated_call.returncode == 0, colocated_call.stderr
    colocated_out = stream_messages(colocated_call.stdout)
    assert colocated_out[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert colocated_out[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 5}

    body.update(room="grpcurl-2", prefill_address=prefill.address)
    pd_call = grpcurl(decode.address, "pdserve.v1.Worker/Generate", body=body)
    assert pd_call.returncode == 0, pd_call.stderr
    # How tokens group into stream messages depends on how fast the reader drains the stream;
    # the tokens themselves must match exactly.
    assert stream_tokens(stream_messages(pd_call.stdout)) == stream_tokens(colocated_out)

    bad = grpcurl(colocated.address, "pdserve.v1.Worker/Generate",
                  body={"room": "bad", "prompt_token_ids": [], "sampling": {}})
    assert bad.returncode != 0 and "InvalidArgument" in bad.stderr and "empty" in bad.stderr

    workers = grpcurl(bootstrap.address, "pdserve.v1.Bootstrap/List", body={})
    roles = sorted(w["role"] for w in json.loads(workers.stdout)["workers"])
    assert roles == ["WORKER_ROLE_COLOCATED", "WORKER_ROLE_DECODE", "WORKER_ROLE_PREFILL"]
