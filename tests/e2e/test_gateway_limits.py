"""The gateway against bad, huge, slow and too many requests (issue 9), as real processes.

One colocated worker (tiny model) behind three gateways: `main` (default limits, a short body
deadline), `admit` (admission control with one slot and a queue of one) and `auth` (an API key
from PDSERVE_API_KEY, /metrics guarded). The corpus of bad values runs over ONE keep-alive
connection: every answer must be a 400 with an OpenAI error body naming the field, and the
connection must still serve the next request.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import psutil
import pytest

from tests.e2e.cluster import Cluster, Proc, wait_until, worker_args
from tests.e2e.http_wire import Wire, chunk, request_bytes

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MODEL = "tiny"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TEXT = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
KEY = "sk-test-0123456789"


@dataclass
class Gateways:
    cluster: Cluster
    worker: Proc
    main: Proc
    admit: Proc
    auth: Proc


def router(model_dir, worker: Proc, *extra: str) -> list[str]:
    return ["launch-router", "--model-path", str(model_dir), "--port", "0", "--worker", f"http://{worker.address}",
            *extra]


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateways]:
    from tools.models.tiny_model import write_tiny_model

    model_dir = write_tiny_model(tmp_path_factory.mktemp("model") / MODEL, preset="tiny", seed=0)
    with Cluster(tmp_path_factory.mktemp("limits")) as cluster:
        try:
            worker = cluster.start("colocated", worker_args(str(model_dir), "null"))
            main, admit = cluster.start_many([
                ("gateway-main", router(model_dir, worker, "--body-read-timeout", "2")),
                ("gateway-admit", router(model_dir, worker, "--max-concurrent-requests", "1",
                                         "--queue-size", "1", "--queue-timeout", "2", "--retry-after", "7"))])
            cluster.env["PDSERVE_API_KEY"] = KEY
            auth = cluster.start("gateway-auth", router(model_dir, worker, "--metrics-require-api-key"))
            cluster.env.pop("PDSERVE_API_KEY")
            for gateway in (main, admit, auth):  # ready once a health probe has reached the worker
                wait_until(lambda g=gateway: httpx.get(f"http://{g.address}/health", timeout=5).status_code
                           == 200, 30, f"{gateway.name} to be ready")
            yield Gateways(cluster, worker, main, admit, auth)
        except BaseException:
            print(cluster.logs())
            raise


def assert_error(answer, status: int, param: str | None = "any", code: str | None = "any") -> dict:
    assert answer.status == status, answer.body[:500]
    body = answer.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    if param != "any":
        assert body["error"]["param"] == param, body
    if code != "any":
        assert body["error"]["code"] == code, body
    return body["error"]


def raw(value: dict) -> bytes:
    """JSON as a client writes it: a lone surrogate stays an escape (`\\ud800`), as on the wire."""
    return json.dumps(value).encode()


# (path, body bytes, param the error names). Every one was a 500 or an accepted request before.
CORPUS: list[tuple[str, bytes, str | None]] = [
    ("/v1/chat/completions", raw({**CHAT, "top_k": 1099511627776}), "top_k"),
    ("/v1/chat/completions", raw({**CHAT, "stop_token_ids": [1099511627776]}), "stop_token_ids.0"),
    ("/v1/chat/completions", raw({**CHAT, "stop_token_ids": [4096]}),
     "stop_token_ids"),  # past the vocabulary
    ("/v1/chat/completions", raw({**CHAT, "seed": 2**70}), "seed"),
    ("/v1/chat/completions", raw({**CHAT, "seed": -(2**63) - 1}), "seed"),
    ("/v1/chat/completions", raw({**CHAT, "messages": [{"role": "user", "content": "\ud800 x"}]}),
     "messages.0.content"),
    ("/v1/chat/completions",
     raw({**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}),
     "messages.0.content"),
    ("/v1/chat/completions", raw({**CHAT, "messages": [{"role": "user", "content": "x", "name": "\ud800"}]}),
     "messages.0"),
    ("/v1/chat/completions", raw({**CHAT, "stop": ["\ud800"]}), "stop"),
    ("/v1/chat/completions", raw({**CHAT, "user": "\udfff"}), "user"),
    ("/v1/chat/completions", raw({**CHAT, "model": "\ud800"}), "model"),
    ("/v1/chat/completions", raw({**CHAT, "tools": [{"type": "function", "function": {"name": "\ud800"}}]}),
     "tools.0.function.name"),
    ("/v1/chat/completions", raw({**CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"\ud800": {}}}}]}), "tools.0.function.parameters"),
    ("/v1/chat/completions", raw({**CHAT, "chat_template_kwargs": {"\ud800": True}}), "chat_template_kwargs"),
    ("/v1/chat/completions", raw({**CHAT, "max_tokens": 2**40}), "max_tokens"),
    ("/v1/chat/completions", raw({**CHAT, "max_tokens": 5000}), "max_tokens"),  # past the context
    ("/v1/chat/completions", raw({**CHAT, "temperature": "0.5"}), "temperature"),  # strict: no coercion
    ("/v1/chat/completions", raw({**CHAT, "n": True}), "n"),
    ("/v1/chat/completions", raw({**CHAT, "n": 129}), "n"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
                             b'"temperature": NaN}',
     "temperature"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
                             b'"top_p": Infinity}',
     "top_p"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [', None),  # malformed JSON
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
     None),
    ("/v1/completions", raw({**TEXT, "prompt": [[1, 2], [4096]]}), "prompt"),
    ("/v1/completions", raw({**TEXT, "prompt": [1, -1]}), "prompt"),
    ("/v1/completions", raw({**TEXT, "prompt": ["a"] * 1000, "n": 128}), "n"),  # 128,000 generations
    ("/v1/completions", raw({**TEXT, "prompt": ["a"] * 300}), "prompt"),
    ("/v1/completions", raw({**TEXT, "best_of": 0}), "best_of"),
    ("/v1/completions", raw({**TEXT, "best_of": 128, "prompt": ["a", "b", "c"]}), "best_of"),
    ("/v1/completions", raw({**TEXT, "echo": True}), "echo"),
    ("/v1/completions", raw({**TEXT, "presence_penalty": 2.5}), "presence_penalty"),
    ("/v1/completions", raw({**TEXT, "prompt": "\ud800"}), "prompt"),
    ("/generate", raw({"text": "\ud800", "sampling_params": {"max_new_tokens": 2}}), "text"),
    ("/generate", raw({"text": "hi", "rid": "\ud800"}), "rid"),
    ("/generate", raw({"text": "hi", "rid": "a b\r\nX-Injected: 1"}), "rid"),
    ("/generate", raw({"text": "hi", "sampling_params": {"top_k": 2**31}}), "sampling_params.top_k"),
    ("/generate", raw({"text": "hi", "sampling_params": {"temperature": 1e39}}),
     "sampling_params.temperature"),
    ("/generate", raw({"input_ids": [[1]] * 257}), "input_ids"),
]


def test_bad_values_get_400_naming_the_field_and_keep_the_connection(gateways: Gateways) -> None:
    with Wire(gateways.main.address) as wire:
        for path, body, param in CORPUS:
            answer = wire.post(path, body)
            error = assert_error(answer, 400, param=param)
            assert error["type"] == "invalid_request_error"
            assert not answer.will_close and wire.is_open(), (path, body[:80])
        # the same connection still serves a real request
        answer = wire.post("/v1/chat/completions", raw({**CHAT, "temperature": 0}))
        assert answer.status == 200 and answer.json()["choices"][0]["message"]["content"] is not None
    assert "Traceback" not in gateways.main.log()


def test_fanout_over_the_limit_starts_no_generation(gateways: Gateways) -> None:
    routed = gateways.main.metric("pdserve:gateway_worker_requests_total")
    with Wire(gateways.main.address) as wire:
        answer = wire.post("/v1/completions", raw({**TEXT, "prompt": ["x"] * 1000, "n": 128}))
    error = assert_error(answer, 400, param="n", code="too_many_generations")
    assert "128000 generations" in error["message"]
    assert gateways.main.metric("pdserve:gateway_worker_requests_total") == routed


def test_body_over_the_limit_is_refused_before_it_is_read(gateways: Gateways) -> None:
    with Wire(gateways.main.address) as wire:  # headers only: the 10 MB body is never sent
        wire.send(request_bytes("POST", "/v1/chat/completions", None, {"Content-Length": str(10_000_000),
                                                                         "Expect": "100-continue"}))
        answer = wire.read_answer()
        assert "larger than the limit of 2097152 bytes" in assert_error(answer, 413)["message"]
        assert answer.will_close
    with Wire(gateways.main.address) as wire:  # chunked: refused as soon as it passes the limit
        wire.send(request_bytes("POST", "/v1/completions", b"", {"Transfer-Encoding": "chunked"}))
        wire.send(chunk(b'{"model": "tiny", "prompt": "' + b"x" * (1 << 20)))
        wire.send(chunk(b"x" * (3 << 19)))  # 2.5 MiB in all; the end of the body never comes
        answer = wire.read_answer()
        assert_error(answer, 413)
        assert answer.will_close
    assert httpx.get(f"http://{gateways.main.address}/health", timeout=10).status_code == 200


def test_slow_body_is_refused_at_the_deadline(gateways: Gateways) -> None:
    with Wire(gateways.main.address) as wire:
        wire.send(request_bytes("POST", "/v1/completions", None, {"Content-Length": "100"}) + b'{"model": ')
        answer = wire.read_answer()  # the rest never comes; --body-read-timeout 2
    assert "not received within 2s" in assert_error(answer, 408)["message"]
    assert answer.will_close


def test_prompts_far_beyond_the_context_are_refused_without_tokenizing(gateways: Gateways) -> None:
    rss_before = psutil.Process(gateways.main.popen.pid).memory_info().rss
    message = {**CHAT, "messages": [{"role": "user", "content": "hello world " * 160_000}]}  # 1.9 MB
    with Wire(gateways.main.address) as wire:
        for _ in range(5):
            answer = wire.post("/v1/chat/completions", raw(message))
            error = assert_error(answer, 400, param="messages", code="context_length_exceeded")
            assert "at least" in error["message"] and "4096" in error["message"]
    growth = psutil.Process(gateways.main.popen.pid).memory_info().rss - rss_before
    assert growth < 150 << 20, f"gateway RSS grew by {growth >> 20} MB"  # tokenizing it: about 0.3 GB


def test_best_of_returns_the_best_n(gateways: Gateways) -> None:
    body = {**TEXT, "prompt": ["The river", "Once"], "max_tokens": 4, "n": 1, "best_of": 3,
            "temperature": 1.0, "seed": 5}
    answer = httpx.post(f"http://{gateways.main.address}/v1/completions", json=body, timeout=60).json()
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert answer["usage"]["completion_tokens"] == 2 * 3 * 4  # every candidate is generated
    assert all(c["logprobs"] is None for c in answer["choices"])  # used for ranking, not asked for
    with httpx.stream("POST", f"http://{gateways.main.address}/v1/completions", json={**body, "stream": True},
                      timeout=60) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    streamed = sorted((json.loads(e)["choices"][0]["index"], json.loads(e)["choices"][0]["text"])
                      for e in events[:-1])
    assert streamed == [(c["index"], c["text"]) for c in answer["choices"]]  # same seed, same best


# -- admission control ----------------------------------------------------------------------------

def _hold_slot(address: str, started: threading.Event, stop: threading.Event) -> None:
    """A streaming request that holds the only slot until `stop` is set (then hangs up)."""
    body = {**TEXT, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"http://{address}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for _ in response.iter_lines():
            started.set()
            if stop.is_set():
                return


def test_admission_sheds_with_429_and_retry_after(gateways: Gateways) -> None:
    gateway = gateways.admit
    base = f"http://{gateway.address}"
    started, stop = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold_slot, args=(gateway.address, started, stop))
    holder.start()
    try:
        assert started.wait(60)
        # second request: waits in the queue (size 1) until --queue-timeout 2 sheds it
        queued: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: queued.append(httpx.post(f"{base}/v1/completions", json=TEXT,
                                                                          timeout=60)))
        waiter.start()
        wait_until(lambda: gateway.metric("pdserve:gateway_admission_waiting_requests", model=MODEL) == 1, 30,
                   "the second request to wait for admission")
        # third request: the queue is full -> 429 at once
        full = httpx.post(f"{base}/v1/chat/completions", json=CHAT, timeout=60)
        assert full.status_code == 429 and full.headers["retry-after"] == "7"
        assert full.json()["error"]["code"] == "server_overloaded"
        assert full.json()["error"]["type"] == "rate_limit_error"
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200  # health never queues
        waiter.join(60)
        assert queued[0].status_code == 429 and queued[0].headers["retry-after"] == "7"
        assert "waited 2s" in queued[0].json()["error"]["message"]
        assert gateway.metric("pdserve:gateway_shed_requests_total", reason="queue_full") == 1
        assert gateway.metric("pdserve:gateway_shed_requests_total", reason="queue_timeout") == 1
    finally:
        stop.set()
        holder.join(60)
    # the slot comes back when the stream ends; a client that leaves the queue frees its place
    wait_until(lambda: gateway.metric("pdserve:gateway_admission_running_slots", model=MODEL) == 0, 30,
               "the holder's slot to be released")
    assert httpx.post(f"{base}/v1/completions", json=TEXT, timeout=60).status_code == 200
    assert gateway.metric("pdserve:gateway_admission_running_slots", model=MODEL) == 0


def test_a_client_leaving_the_queue_frees_its_place(gateways: Gateways) -> None:
    gateway = gateways.admit
    started, stop = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold_slot, args=(gateway.address, started, stop))
    holder.start()
    try:
        assert started.wait(60)
        body = json.dumps(TEXT).encode()
        host, port = gateway.address.split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(request_bytes("POST", "/v1/completions", body))
            wait_until(lambda: gateway.metric("pdserve:gateway_admission_waiting_requests",
                                              model=MODEL) == 1, 30, "the request to wait for admission")
        # hung up while queued: its place is freed long before --queue-timeout could shed it
        wait_until(lambda: gateway.metric("pdserve:gateway_admission_waiting_requests", model=MODEL) == 0, 30,
                   "the queue to forget the client that left")
    finally:
        stop.set()
        holder.join(60)
    wait_until(lambda: gateway.metric("pdserve:gateway_admission_running_slots", model=MODEL) == 0, 30,
               "every slot to be released")


# -- API key --------------------------------------------------------------------------------------

def test_api_key_guards_every_route_but_health(gateways: Gateways) -> None:
    base = f"http://{gateways.auth.address}"
    with Wire(gateways.auth.address) as wire:
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", TEXT),
                           ("/generate", {"text": "x"})):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                            {"Authorization": f"Basic {KEY}"}):
                answer = wire.post(path, raw(body), headers)
                error = assert_error(answer, 401, param=None, code="invalid_api_key")
                assert error["type"] == "invalid_request_error"
                assert wire.is_open()
        for path in ("/v1/models", "/v1/models/tiny", "/metrics", "/no-such-route"):
            assert_error(wire.get(path), 401, code="invalid_api_key")
        assert wire.get("/health").status == 200
        assert wire.get("/openapi.json").status == 200
        good = {"Authorization": f"Bearer {KEY}"}
        assert wire.post("/v1/chat/completions", raw(CHAT), good).status == 200
        assert wire.post("/v1/completions", raw(TEXT), {"authorization": f"bearer {KEY}"}).status == 200
        assert wire.get("/metrics", good).status == 200
        assert wire.get("/v1/models", good).json()["data"][0]["id"] == MODEL
    spec = httpx.get(f"{base}/openapi.json", timeout=10).json()
    assert spec["components"]["securitySchemes"] == {"bearerAuth": {"type": "http", "scheme": "bearer"}}
    assert spec["paths"]["/v1/completions"]["post"]["security"] == [{"bearerAuth": []}]
    assert "security" not in spec["paths"]["/health"]["get"]
    # the key never shows in the logs or the flags' help
    assert KEY not in gateways.auth.log()
