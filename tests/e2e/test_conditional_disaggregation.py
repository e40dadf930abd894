"""Conditional disaggregation: a decode worker that runs some prompts itself gives the same greedy
output as shipping every prompt to prefill (and as a colocated worker), and leaks no KV page.

The decode worker runs with `--conditional-disaggregation --local-prefill-max-tokens 64`: the
prompts of at most 64 tokens run on it, the longer ones on the prefill worker; requests without a
prefill worker run on it too. Through the gateway, a registry with a conditional decode and no
prefill still serves, while a plain decode alone cannot.
"""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.cluster import Cluster, wait_until, worker_args
from tests.e2e.test_pd_services import CHUNK, LENGTHS, NEW_TOKENS, assert_pages_idle, prompts_of
from tests.e2e.worker_client import run_all

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

THRESHOLD = 64
CONDITIONAL = ("--conditional-disaggregation", "--local-prefill-max-tokens", str(THRESHOLD))


def test_local_and_shipped_prompts_match_plain_pd_and_colocated(cluster: Cluster, tiny_model):
    prompts = prompts_of(LENGTHS)
    prefill, plain, conditional, colocated = cluster.start_many([
        ("prefill", worker_args(tiny_model, "prefill", backend="mooncake", extra=CHUNK)),
        ("decode-plain", worker_args(tiny_model, "decode", backend="mooncake", extra=CHUNK)),
        ("decode-conditional", worker_args(tiny_model, "decode", backend="mooncake",
                                           extra=(*CHUNK, *CONDITIONAL))),
        ("colocated", worker_args(tiny_model, "null", extra=CHUNK)),
    ])
    shipped = run_all(plain.address, prompts, [prefill.address] * len(prompts), max_new_tokens=NEW_TOKENS)
    mixed = run_all(conditional.address, prompts, [prefill.address] * len(prompts), max_new_tokens=NEW_TOKENS)
    no_prefill = run_all(conditional.address, prompts, max_new_tokens=NEW_TOKENS)
    reference = run_all(colocated.address, prompts, max_new_tokens=NEW_TOKENS)
    for length, a, b, c, ref in zip(LENGTHS, shipped, mixed, no_prefill, reference, strict=True):
        for result in (a, b, c, ref):
            assert result.code is None, f"prompt of {length} tokens failed: {result.code} {result.details}"
        assert b.tokens == a.tokens, f"prompt of {length} tokens: conditional PD differs from plain PD"
        assert c.tokens == a.tokens, f"prompt of {length} tokens: local prefill differs from plain PD"
        assert a.tokens == ref.tokens, f"prompt of {length} tokens: PD differs from colocated"

    short = sum(1 for n in LENGTHS if n <= THRESHOLD)
    assert conditional.metric("pdserve:local_prefill_requests_total", reason="short_prompt") == short
    assert conditional.metric("pdserve:local_prefill_requests_total", reason="no_prefill") == len(LENGTHS)
    assert plain.metric("pdserve:local_prefill_requests_total") == 0
    # the plain decode refuses a request without a prefill worker, naming the flag that allows it
    (refused,) = run_all(plain.address, [prompts[0]], max_new_tokens=4)
    assert refused.code is not None and "--conditional-disaggregation" in refused.details
    assert_pages_idle(prefill, plain, conditional, colocated)


def _completion(url: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "Hello there", "max_tokens": 8,
                                                     "temperature": 0, "ignore_eos": True}, timeout=60)


def test_gateway_routes_to_a_conditional_decode_when_no_prefill_is_up(cluster: Cluster, tiny_model):
    bootstrap = cluster.bootstrap()
    decode = cluster.start("decode", worker_args(tiny_model, "decode", backend="mooncake",
                                                 bootstrap=bootstrap, extra=CONDITIONAL))
    gateway = cluster.start("gateway", ["launch-router", "--model-path", str(tiny_model), "--port", "0",
                                        "--bootstrap", bootstrap.address])
    url, model = f"http://{gateway.address}", tiny_model.name
    wait_until(lambda: _completion(url, model).status_code == 200, 60,
               "the gateway to serve through decode alone")
    assert decode.metric("pdserve:local_prefill_requests_total", reason="no_prefill") >= 1

    plain = cluster.start("decode-plain", worker_args(tiny_model, "decode", backend="mooncake"))
    gateway_plain = cluster.start("gateway-plain", ["launch-router", "--model-path", str(tiny_model),
                                                    "--port", "0", "--decode", plain.address])
    response = _completion(f"http://{gateway_plain.address}", model)
    assert response.status_code == 503, response.text
    assert "no healthy prefill" in response.json()["error"]["message"]
    assert_pages_idle(decode, plain)
