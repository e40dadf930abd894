"""Migration mid-answer keeps a request's grammar and penalty counts: registry + 1 prefill + 3
decodes (mooncake) + gateway.

A greedy stream under a JSON schema, then one with presence and frequency penalties, each run once
undisturbed and once with the decode serving it killed (-9) after a few chunks. The gateway
continues each on another decode with the tokens already delivered (services/gateway/migration.py)
and that worker rebuilds the grammar state and the penalty counts from them: the migrated stream's
text and token count equal the undisturbed run's, the JSON still parses, and every surviving
worker's KV pages go back to idle.
"""

from __future__ import annotations

from typing import Annotated

import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.e2e.cluster import Cluster, Proc, wait_until, worker_args
from tests.e2e.test_migration import KILL_AFTER, read_stream
from tests.e2e.test_pd_services import assert_pages_idle

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

BOUND_S = 60.0
MESSAGES = [{"role": "user", "content": "Tell me a story in JSON."}]
Line = Annotated[str, Field(min_length=10, max_length=16)]


class Chapter(BaseModel):
    model_config = ConfigDict(extra="forbid")  # no properties beyond these: the answer has an end

    title: Line
    lines: Annotated[list[Line], Field(min_length=4, max_length=4)]


class Story(BaseModel):  # long enough (20 strings of 10 or more characters) to be killed mid-answer
    model_config = ConfigDict(extra="forbid")

    chapters: Annotated[list[Chapter], Field(min_length=4, max_length=4)]


SCHEMA = {"type": "json_schema", "json_schema": {"name": "Story", "strict": True,
                                                 "schema": Story.model_json_schema()}}
# the +14 bias makes greedy repeat token 100; the penalties push it back once it has appeared, so the
# answer depends on the counts carried across the migration
PENALTIES = {"presence_penalty": 1.5, "frequency_penalty": 1.0, "logit_bias": {"100": 14}}


def stream(gateway: Proc, decodes: list[Proc] | None = None, **request) -> tuple[str, str | None, int]:
    """(text, finish reason, completion tokens) of one greedy chat stream; with `decodes`, the one
    serving it is killed after KILL_AFTER chunks."""
    chunks = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", max_retries=0,
                           timeout=BOUND_S).chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0, stream=True, stream_options={"include_usage": True},
        **request)
    text, finish, usage = read_stream(chunks, gateway, decodes)
    return text, finish, usage.completion_tokens if usage is not None else 0


def test_a_migrated_answer_keeps_its_grammar_and_penalties(cluster: Cluster, tiny_model) -> None:
    bootstrap = cluster.bootstrap()
    prefill, *decodes = cluster.start_many(
        [("prefill", worker_args(tiny_model, "prefill", backend="mooncake", bootstrap=bootstrap))]
        + [(f"decode-{i}", worker_args(tiny_model, "decode", backend="mooncake", bootstrap=bootstrap))
           for i in range(3)])
    gateway = cluster.start("gateway", ["launch-router", "--model-path", str(tiny_model), "--port", "0",
                                        "--bootstrap", bootstrap.address])
    wait_until(lambda: httpx.get(f"http://{gateway.address}/health", timeout=5).json().get("workers")
               == {"prefill": 1, "decode": 3, "colocated": 0}, BOUND_S, "the gateway to see every worker")

    constrained = {"response_format": SCHEMA, "max_tokens": 600}
    expected = stream(gateway, **constrained)
    assert expected[1] == "stop" and expected[2] > 3 * KILL_AFTER, expected
    Story.model_validate_json(expected[0])
    migrated = stream(gateway, decodes, **constrained)
    assert migrated == expected
    assert gateway.metric("pdserve:gateway_migrations_total") == 1

    penalized = {"max_tokens": 240, "extra_body": {"ignore_eos": True}, **PENALTIES}
    expected = stream(gateway, **penalized)
    unpenalized = stream(gateway, max_tokens=240, extra_body={"ignore_eos": True}, logit_bias={"100": 14})
    assert expected[0] != unpenalized[0]  # the penalties change this answer: the check below can fail
    assert stream(gateway, decodes, **penalized) == expected == (expected[0], "length", 240)
    assert gateway.metric("pdserve:gateway_migrations_total") == 2
    assert "migrating off" in gateway.log()
    assert_pages_idle(prefill, *decodes, timeout_s=BOUND_S)
