"""Structured outputs, penalties and logit_bias end to end, through the official openai client:
registry + prefill + decode (mooncake) + gateway, and a colocated worker behind its own gateway.

The tiny model's weights are random, so only the grammar makes its output JSON: each of the twenty
schemas (structured_schemas.py) must come back as a parsed object (`client.chat.completions.parse`),
and greedy answers must be the same token for token colocated and PD (prefill samples the first
token under the grammar and the penalties, decode rebuilds both from the tokens it holds).
Penalties and logit_bias give HF generate's tokens on the colocated worker and through PD. Bad
input is a 400 naming the problem, and leaves no KV page in use. The tests share one deployment;
the schemas on more presets and over nixl are test_structured_presets.py (--long).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest

from protos.v1 import common_pb2
from tests.e2e.cluster import Cluster, Proc, wait_until, worker_args
from tests.e2e.hf import hf_generate
from tests.e2e.structured_schemas import SCHEMAS, Person
from tests.e2e.worker_client import run_all
from tests.engine import test_penalties

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MESSAGES = [{"role": "user", "content": "Answer in JSON."}]
# A schema without "additionalProperties": false lets a random model add properties until max_tokens.
CLOSED = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@dataclass
class Deployment:
    prefill: Proc
    decode: Proc
    colocated: Proc
    pd: Proc        # gateway over prefill + decode
    reference: Proc  # gateway over the colocated worker
    model: str

    def client(self, gateway: Proc) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", max_retries=0,
                             timeout=120)

    def gateways(self) -> tuple[Proc, Proc]:
        return self.pd, self.reference

    def workers(self) -> tuple[Proc, Proc, Proc]:
        return self.prefill, self.decode, self.colocated


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    from tools.models.tiny_model import write_tiny_model

    model = str(write_tiny_model(tmp_path_factory.mktemp("model") / "tiny", preset="tiny", seed=0))
    with Cluster(tmp_path_factory.mktemp("structured-e2e")) as cluster:
        try:
            bootstrap = cluster.bootstrap("--heartbeat-interval", "1")
            prefill, decode, colocated = cluster.start_many([
                ("prefill", worker_args(model, "prefill", backend="mooncake", bootstrap=bootstrap)),
                ("decode", worker_args(model, "decode", backend="mooncake", bootstrap=bootstrap)),
                ("colocated", worker_args(model, "null"))], 180)
            pd, reference = cluster.start_many([
                ("gateway", ["launch-router", "--model-path", model, "--port", "0", "--bootstrap",
                             bootstrap.address]),
                ("gateway-ref", ["launch-router", "--model-path", model, "--port", "0",
                                 "--worker", f"http://{colocated.address}"])], 180)
            wait_until(lambda: httpx.get(f"http://{pd.address}/health", timeout=5).json().get("workers")
                       == {"prefill": 1, "decode": 1, "colocated": 0}, 30, "the gateway to find its workers")
            yield Deployment(prefill, decode, colocated, pd, reference, model)
        except BaseException:
            print(cluster.logs())
            raise


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: s.__name__)
def test_parse_returns_the_schema_object_and_pd_equals_colocated(deployment: Deployment, schema) -> None:
    answers = []
    for gateway in deployment.gateways():
        completion = deployment.client(gateway).chat.completions.parse(
            model="tiny", messages=MESSAGES, response_format=schema, max_tokens=300, temperature=0)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, schema)
        answers.append(choice.message.content)
    assert answers[0] == answers[1]


def test_sampled_choices_with_a_seed_are_each_valid_and_reproducible(deployment: Deployment) -> None:
    def ask(gateway: Proc) -> list[str | None]:
        completion = deployment.client(gateway).chat.completions.parse(
            model="tiny", messages=MESSAGES, response_format=Person, max_tokens=300, temperature=0.9,
            seed=7, n=3)
        assert all(isinstance(c.message.parsed, Person) for c in completion.choices)
        return [c.message.content for c in completion.choices]

    pd = ask(deployment.pd)
    assert len(set(pd)) > 1  # n seeded choices are distinct samples
    assert pd == ask(deployment.pd) == ask(deployment.reference)


def test_penalties_and_logit_bias_pd_equal_colocated(deployment: Deployment) -> None:
    def ask(gateway: Proc, **extra) -> str | None:
        return deployment.client(gateway).chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=24, temperature=0, **extra).choices[0].message.content

    bias = {"logit_bias": {"100": 14}}  # makes greedy repeat token 100: what the penalties push back
    for extra, baseline in (
            ({"presence_penalty": 1.5, "frequency_penalty": 1.0, **bias}, bias),
            ({"extra_body": {"repetition_penalty": 1.7}, **bias}, bias),
            ({"logit_bias": {"300": 30, "301": 29}}, {}),
            ({"extra_body": {"min_tokens": 5}, "logit_bias": {"2": 100}}, {"logit_bias": {"2": 100}})):
        pd, colocated = ask(deployment.pd, **extra), ask(deployment.reference, **extra)
        assert pd == colocated, extra
        assert pd != ask(deployment.pd, **baseline), f"{extra} changed nothing"


def test_penalties_and_logit_bias_equal_hf_generate_pd_and_colocated(deployment: Deployment) -> None:
    """The engine's penalty cases (tests/engine/test_penalties.py) sent to the colocated worker and
    to the decode worker with the prefill's address, as the gateway sends them: the output ids equal
    HF generate's with the equivalent logits processors."""
    new_tokens = test_penalties.NEW_TOKENS
    for prompt, (case, processors) in zip(test_penalties.PROMPTS, test_penalties.CASES, strict=True):
        params = test_penalties.params_of(case)
        expected = hf_generate(deployment.model, prompt, new_tokens, processors(len(prompt)),
                               eos_token_id=None if params.ignore_eos else test_penalties.EOS)
        sampling = common_pb2.SamplingParams(
            temperature=0.0, max_new_tokens=new_tokens, ignore_eos=params.ignore_eos,
            presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty, logit_bias=dict(params.logit_bias),
            min_tokens=params.min_tokens)
        pd = (deployment.decode, deployment.prefill.address)
        for worker, prefill in ((deployment.colocated, None), pd):
            (result,) = run_all(worker.address, [prompt], [prefill], sampling=sampling)
            assert result.code is None, (worker.name, case, result.details)
            assert result.tokens == expected, (worker.name, case)


def test_vllm_and_sglang_constraint_fields(deployment: Deployment) -> None:
    client = deployment.client(deployment.pd)

    def vllm(structured: dict) -> str:
        content = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=200, temperature=0,
            extra_body={"structured_outputs": structured}).choices[0].message.content
        assert content is not None
        return content

    assert re.fullmatch(r"[a-c]{2,4}-[0-9]", vllm({"regex": "[a-c]{2,4}-[0-9]"}))
    assert vllm({"choice": ["alpha", "beta", "gamma"]}) in ("alpha", "beta", "gamma")
    assert vllm({"grammar": 'root ::= "yes" | "no"'}) in ("yes", "no")
    assert Person.model_validate_json(vllm({"json": Person.model_json_schema()}))
    for params, check in (({"regex": "[0-9]{3}"}, r"[0-9]{3}"),
                          ({"ebnf": 'root ::= "on" | "off"'}, r"on|off"),
                          ({"json_schema": json.dumps(CLOSED)}, None)):
        body = {"text": "Answer:", "sampling_params": {"max_new_tokens": 40, "temperature": 0, **params}}
        text = httpx.post(f"http://{deployment.pd.address}/generate", json=body, timeout=60).json()["text"]
        if check is None:
            assert isinstance(json.loads(text)["ok"], bool)
        else:
            assert re.fullmatch(check, text), (params, text)


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "string", "format": "no-such-format"}}}},
     "no-such-format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, "objectx"),
    ({"structured_outputs": {"regex": "(("}}, "regex"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "grammar"),
    ({"logit_bias": {"999999": 5}}, "vocabulary"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"logit_bias": {"5": -101}}, "logit_bias"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"tools": [{"type": "function", "function": {"name": "get_time", "parameters": CLOSED}}],
      "tool_choice": {"type": "function", "function": {"name": "get_stock_price"}}}, "get_stock_price"),
]
# SGLang's /generate sampling params: a bad constraint of each kind
BAD_GENERATE = [
    ({"regex": "(("}, "regex"),
    ({"ebnf": "root ::= ("}, "grammar"),
    ({"json_schema": "{not json"}, "json_schema"),
    ({"json_schema": json.dumps({"type": "objectx"})}, "objectx"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"logit_bias": {"999999": 5}}, "vocabulary"),
]


def test_bad_input_is_400_with_its_message_and_pages_go_back_to_idle(deployment: Deployment) -> None:
    for gateway in deployment.gateways():
        for extra, word in BAD:
            body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 10, **extra}
            response = httpx.post(f"http://{gateway.address}/v1/chat/completions", json=body, timeout=60)
            assert response.status_code == 400, (extra, response.text)
            assert word in response.json()["error"]["message"], (extra, response.text)
        for params, word in BAD_GENERATE:
            body = {"text": "Answer:", "sampling_params": {"max_new_tokens": 10, **params}}
            response = httpx.post(f"http://{gateway.address}/generate", json=body, timeout=60)
            assert response.status_code == 400, (params, response.text)
            assert word in response.json()["error"]["message"], (params, response.text)
        # a grammar that cannot finish within max_tokens is cut there, as any answer
        cut = deployment.client(gateway).chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "Person",
                                                                    "schema": Person.model_json_schema()}})
        assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 6
    for worker in deployment.workers():
        wait_until(lambda worker=worker: worker.metric("pdserve:kv_pages_used") == 0, 30,
                   f"{worker.name}'s pages to be free")
    assert deployment.colocated.metric("pdserve:grammar_compiles_total") > 0
    assert deployment.colocated.metric("pdserve:grammar_refused_total") > 0
    assert deployment.decode.metric("pdserve:grammar_constrained_steps_total") > 0
    assert deployment.prefill.metric("pdserve:grammar_cache_hits_total") > 0
