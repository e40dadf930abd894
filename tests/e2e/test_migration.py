"""Request migration end to end: registry + 1 prefill + 3 decodes (mooncake) + two gateways.

A long greedy stream through the official `openai` client; once tokens flow, the decode serving it
is killed (-9). With migration (the default) the stream completes with no error and its text
equals a fault-free run of the same request, the gateway counts one migration, and the surviving
workers' KV pages return to 0. With `--migration-limit 0` the same fault ends the stream with
today's clear error event.
"""

from __future__ import annotations

import signal
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.cluster import Cluster, Proc, wait_until, worker_args
from tests.e2e.test_pd_services import assert_pages_idle

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

BACKEND = "mooncake"
BOUND_S = 60.0
MESSAGES = [{"role": "user", "content": "Tell me a long story about the river and the city."}]
MAX_TOKENS = 300
KILL_AFTER = 8  # content chunks received before the serving decode is killed


def client(gateway: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", max_retries=0,
                         timeout=BOUND_S)


def stream(gateway: Proc, decodes: list[Proc] | None = None) -> tuple[str, str | None, object]:
    """(text, finish reason, usage) of one greedy chat stream; with `decodes`, the one serving it
    is killed after KILL_AFTER chunks (it is removed from the list)."""
    chunks = client(gateway).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    return read_stream(chunks, gateway, decodes)


def read_stream(chunks, gateway: Proc, decodes: list[Proc] | None = None) -> tuple[str, str | None, Any]:
    """(text, finish reason, usage) of a chat stream's chunks through `gateway`; with `decodes`, the
    one serving it is killed after KILL_AFTER content chunks (it is removed from the list)."""
    text, finish, usage, received = "", None, None, 0
    for chunk in chunks:
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        received += 1
        if decodes is not None and received == KILL_AFTER:
            kill_serving(gateway, decodes)
    return text, finish, usage


def kill_serving(gateway: Proc, decodes: list[Proc]) -> None:
    """SIGKILL the decode that `gateway` has the stream open on. Every decode is frozen while the
    gateway is asked which one that is: a loaded machine can leave this client far behind the
    decode, and a decode left running could finish the answer before it is killed."""
    for decode in decodes:
        decode.send(signal.SIGSTOP)
    try:
        open_on = {d.name: gateway.metric("pdserve:gateway_worker_inflight_requests", worker=d.address,
                                          role="decode") for d in decodes}
        serving = [d for d in decodes if open_on[d.name] > 0]
        assert len(serving) == 1, open_on
        serving[0].kill(signal.SIGKILL)
        decodes.remove(serving[0])
    finally:
        for decode in decodes:
            decode.send(signal.SIGCONT)


def test_a_killed_decode_is_invisible_with_migration(cluster: Cluster, tiny_model):
    bootstrap = cluster.bootstrap()
    workers = cluster.start_many(
        [("prefill", worker_args(tiny_model, "prefill", backend=BACKEND, bootstrap=bootstrap))]
        + [(f"decode-{i}", worker_args(tiny_model, "decode", backend=BACKEND, bootstrap=bootstrap))
           for i in range(3)])
    prefill, decodes = workers[0], list(workers[1:])
    gateway, unmigrated = cluster.start_many([
        ("gateway", ["launch-router", "--model-path", str(tiny_model), "--port", "0",
                     "--bootstrap", bootstrap.address]),
        ("gateway-no-migration", ["launch-router", "--model-path", str(tiny_model), "--port", "0",
                                  "--bootstrap", bootstrap.address, "--migration-limit", "0"])])
    for g in (gateway, unmigrated):
        wait_until(lambda g=g: httpx.get(f"http://{g.address}/health", timeout=5).json().get("workers")
                   == {"prefill": 1, "decode": 3, "colocated": 0}, BOUND_S, f"{g.name} to see every worker")

    expected_text, expected_finish, expected_usage = stream(gateway)
    assert expected_finish == "length" and expected_usage.completion_tokens == MAX_TOKENS

    text, finish, usage = stream(gateway, decodes)  # the serving decode dies mid-stream
    assert (finish, usage.completion_tokens, usage.prompt_tokens) == ("length", MAX_TOKENS,
                                                                      expected_usage.prompt_tokens)
    assert text == expected_text  # greedy: no token repeated, lost or changed
    assert gateway.metric("pdserve:gateway_migrations_total") == 1
    assert "migrating off" in gateway.log()
    assert_pages_idle(prefill, *decodes, timeout_s=BOUND_S)

    # --migration-limit 0: the same fault is today's clear error event
    with pytest.raises(openai.APIError, match="mid-stream"):
        stream(unmigrated, decodes)
    assert unmigrated.metric("pdserve:gateway_migrations_total") == 0
    assert_pages_idle(prefill, *decodes, timeout_s=BOUND_S)
