"""The gateway end to end: registry + 2 prefill + 1 decode (mooncake) + gateway, as real processes.

A second gateway in front of a colocated worker gives the reference outputs: greedy text through
PD must equal the colocated worker's, for every OpenAI feature the official client uses. Then:
client disconnects free KV pages on both workers, a worker started later gets traffic, bad input
gets its status and body, and killing a prefill worker under load is invisible to clients.
The tests of this module share one cluster and run in file order (the last one kills a worker).
"""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.cluster import Cluster, Proc, wait_until
from tests.e2e.conftest import leak_detections

pytestmark = [pytest.mark.e2e, pytest.mark.alone, pytest.mark.timeout(600)]

BACKEND = "mooncake"
PROMPTS = ["The history of the city begins", "def fibonacci(n):", "Once upon a time, in a small village,"]
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Tell me about the river."}]


@dataclass
class System:
    cluster: Cluster
    model_dir: Path
    model: str
    bootstrap: Proc
    prefills: list[Proc]
    decode: Proc
    colocated: Proc
    gateway: Proc        # PD, discovers workers through the registry
    reference: Proc      # colocated worker behind a static gateway

    def client(self, gateway: Proc | None = None) -> openai.OpenAI:
        target = gateway or self.gateway
        return openai.OpenAI(base_url=f"http://{target.address}/v1", api_key="unused", max_retries=0,
                             timeout=120)

    def url(self, path: str, gateway: Proc | None = None) -> str:
        return f"http://{(gateway or self.gateway).address}{path}"


def start_parallel(cluster: Cluster, specs: list[tuple[str, list[str]]],
                   timeout_s: float = 180) -> list[Proc]:
    """Start several services at once (model loading overlaps), then wait for each ready line."""
    return cluster.start_many(specs, timeout_s)


def worker_args(model: Path, mode: str, bootstrap: Proc | None) -> list[str]:
    args = ["launch-server", "--model-path", str(model), "--disaggregation-mode", mode, "--port", "0",
            "--metrics-port", "0", "--disaggregation-transfer-backend", BACKEND, "--num-threads", "1",
            "--num-pages", "256"]
    return args + (["--bootstrap", bootstrap.address] if bootstrap is not None else [])


def gateway_health(system: System) -> dict:
    response = httpx.get(system.url("/health"), timeout=5)
    return response.json()


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    from tools.models.tiny_model import write_tiny_model

    model_dir = write_tiny_model(tmp_path_factory.mktemp("model") / "tiny", preset="tiny", seed=0)
    with Cluster(tmp_path_factory.mktemp("gateway-e2e")) as cluster:
        try:
            bootstrap = cluster.bootstrap("--heartbeat-interval", "1")
            prefill_0, prefill_1, decode, colocated = start_parallel(cluster, [
                ("prefill-0", worker_args(model_dir, "prefill", bootstrap)),
                ("prefill-1", worker_args(model_dir, "prefill", bootstrap)),
                ("decode-0", worker_args(model_dir, "decode", bootstrap)),
                ("colocated", worker_args(model_dir, "null", None))])
            gateway, reference = start_parallel(cluster, [
                ("gateway", ["launch-router", "--model-path", str(model_dir), "--port", "0", "--bootstrap",
                             bootstrap.address, "--policy", "round_robin"]),
                ("gateway-ref", ["launch-router", "--model-path", str(model_dir), "--port", "0",
                                 "--worker", f"http://{colocated.address}"])])
            system = System(cluster, model_dir, "tiny", bootstrap, [prefill_0, prefill_1], decode, colocated,
                            gateway, reference)
            wait_until(lambda: gateway_health(system).get("workers")
                       == {"prefill": 2, "decode": 1, "colocated": 0},
                       30, "the gateway to discover 2 prefill and 1 decode workers")
            yield system
            leaks = {name: count for name, count in leak_detections(cluster).items() if count}
            assert not leaks, f"KV page leak detector fired: {leaks}"
        except BaseException:
            print(cluster.logs())
            raise


def both(system: System, call: Callable[[openai.OpenAI], object]) -> tuple:
    return call(system.client()), call(system.client(system.reference))


def test_chat_non_stream_equals_colocated(system: System) -> None:
    pd, ref = both(system, lambda c: c.chat.completions.create(
        model=system.model, messages=CHAT, max_tokens=24, temperature=0))
    assert pd.choices[0].message.content == ref.choices[0].message.content
    assert pd.choices[0].message.content and pd.choices[0].message.role == "assistant"
    assert pd.object == "chat.completion" and pd.model == "tiny"
    assert pd.usage.prompt_tokens == ref.usage.prompt_tokens > 10
    assert pd.usage.completion_tokens == ref.usage.completion_tokens
    assert pd.usage.total_tokens == pd.usage.prompt_tokens + pd.usage.completion_tokens


def test_chat_stream_with_usage_equals_colocated(system: System) -> None:
    def stream(client: openai.OpenAI) -> tuple[str, list, object]:
        chunks = list(client.chat.completions.create(model=system.model, messages=CHAT, max_tokens=24,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, chunks, chunks[-1].usage

    (pd_text, pd_chunks, pd_usage), (ref_text, _, ref_usage) = both(system, stream)
    whole = system.client().chat.completions.create(model=system.model, messages=CHAT, max_tokens=24,
                                                    temperature=0)
    assert pd_text == ref_text == whole.choices[0].message.content
    assert pd_chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in pd_chunks
            if c.choices and c.choices[0].finish_reason] == ["length"]
    assert pd_chunks[-1].choices == [] and pd_usage is not None
    assert (pd_usage.prompt_tokens, pd_usage.completion_tokens) == (ref_usage.prompt_tokens, 24)
    assert pd_usage.prompt_tokens == whole.usage.prompt_tokens


def test_completions_n2_stream_and_not_equal_colocated(system: System) -> None:
    pd, ref = both(system, lambda c: c.completions.create(
        model=system.model, prompt=PROMPTS, max_tokens=16, temperature=0, n=2))
    assert [c.index for c in pd.choices] == list(range(6))
    assert [c.text for c in pd.choices] == [c.text for c in ref.choices]
    for p in range(len(PROMPTS)):  # greedy: both samples of a prompt are the same
        assert pd.choices[2 * p].text == pd.choices[2 * p + 1].text
    assert pd.usage.completion_tokens == 6 * 16

    chunks = list(system.client().completions.create(model=system.model, prompt=PROMPTS[0], max_tokens=16,
                                                     temperature=0, n=2, stream=True))
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts[0] == texts[1] == ref.choices[0].text


def test_stop_strings_equal_colocated(system: System) -> None:
    full = system.client(system.reference).completions.create(model=system.model, prompt=PROMPTS[1],
                                                              max_tokens=24, temperature=0).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), f"need a visible stop string from {full!r}"
    pd, ref = both(system, lambda c: c.completions.create(model=system.model, prompt=PROMPTS[1],
                                                          max_tokens=24, temperature=0,
                                                          stop=[stop, "@@never@@"]))
    assert pd.choices[0].text == ref.choices[0].text == full[:full.index(stop)]
    assert pd.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in system.client().completions.create(
        model=system.model, prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=stop, stream=True)
        if c.choices)
    assert streamed == full[:full.index(stop)]


def test_logprobs_equal_colocated(system: System) -> None:
    pd, ref = both(system, lambda c: c.chat.completions.create(
        model=system.model, messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3))
    pd_content, ref_content = pd.choices[0].logprobs.content, ref.choices[0].logprobs.content
    assert len(pd_content) == 8
    for ours, theirs in zip(pd_content, ref_content, strict=True):
        assert ours.token == theirs.token
        assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-3)
        assert len(ours.top_logprobs) == 3
        assert ours.top_logprobs[0].token == ours.token  # greedy: the chosen token is the most likely
        assert ours.bytes == list(ours.token.encode())
    assert "".join(t.token for t in pd_content) == pd.choices[0].message.content

    text = system.client().completions.create(model=system.model, prompt=PROMPTS[0], max_tokens=6,
                                              temperature=0, logprobs=2)
    logprobs = text.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0 and "".join(logprobs.tokens) == text.choices[0].text


def test_native_generate_equals_colocated(system: System) -> None:
    body = {"text": PROMPTS[2], "sampling_params": {"temperature": 0, "max_new_tokens": 12}}
    pd = httpx.post(system.url("/generate"), json=body, timeout=60).json()
    ref = httpx.post(system.url("/generate", system.reference), json=body, timeout=60).json()
    assert pd["text"] == ref["text"] and pd["output_ids"] == ref["output_ids"]
    assert pd["meta_info"]["completion_tokens"] == 12
    assert pd["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    with httpx.stream("POST", system.url("/generate"), json={**body, "stream": True}, timeout=60) as response:
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["text"] == pd["text"]  # cumulative text, as SGLang streams it


def pages_in_use(proc: Proc) -> float:
    return proc.metric("pdserve:kv_pages_used")


def test_disconnect_mid_stream_frees_pages_on_both_workers(system: System) -> None:
    workers = [*system.prefills, system.decode]
    baseline = {w.name: pages_in_use(w) for w in workers}
    body = {"model": system.model, "prompt": PROMPTS[0] * 40, "max_tokens": 3000, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", system.url("/v1/completions"), json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        received = 0
        for line in lines:
            received += line.startswith("data: ")
            if received == 5:
                break
        assert pages_in_use(system.decode) > baseline["decode-0"]  # the request holds decode pages now
    # the stream is closed: the gateway cancels the call and aborts the room on decode
    wait_until(lambda: all(pages_in_use(w) == baseline[w.name] for w in workers), 15,
               f"KV pages back to {baseline}")
    assert system.gateway.metric("pdserve:gateway_aborts_total") >= 1


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_during_prefill_frees_pages_on_both_workers(system: System, stream: bool) -> None:
    workers = [*system.prefills, system.decode]
    baseline = {w.name: pages_in_use(w) for w in workers}
    aborts = system.gateway.metric("pdserve:gateway_aborts_total")
    # a long prompt (slow prefill) and a client that hangs up before any byte of the answer
    body = json.dumps({"model": system.model, "prompt": [7] * 3500, "max_tokens": 200,
                       "stream": stream}).encode()
    host, port = system.gateway.address.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(0.15)
    wait_until(lambda: system.gateway.metric("pdserve:gateway_aborts_total") > aborts, 15,
               "the gateway to cancel the abandoned request")
    wait_until(lambda: all(pages_in_use(w) == baseline[w.name] for w in workers), 15,
               f"KV pages back to {baseline}")


def test_bad_input_statuses_and_bodies(system: System) -> None:
    client = system.client()
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="no-such-model", messages=CHAT)
    assert not_found.value.status_code == 404 and not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_hot:
        client.completions.create(model=system.model, prompt="x", temperature=7)
    assert too_hot.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=system.model, prompt=[5] * 5000, max_tokens=4)
    assert "4096" in too_long.value.message and "5000" in too_long.value.message
    assert too_long.value.code == "context_length_exceeded"
    # the worker rejects it (INVALID_ARGUMENT): 400 with the worker's own message, no retry
    retries = system.gateway.metric("pdserve:gateway_retries_total")
    with pytest.raises(openai.BadRequestError) as worker_said:
        client.completions.create(model=system.model, prompt="x", max_tokens=4,
                                  extra_body={"stop_token_ids": [-1]})
    assert "stop_token_ids" in worker_said.value.message
    assert system.gateway.metric("pdserve:gateway_retries_total") == retries
    malformed = httpx.post(system.url("/v1/chat/completions"), content=b"{not json",
                           headers={"content-type": "application/json"}, timeout=10)
    assert malformed.status_code == 400 and "malformed JSON" in malformed.json()["error"]["message"]
    assert set(malformed.json()["error"]) == {"message", "type", "param", "code"}
    models = client.models.list()
    assert [m.id for m in models.data] == [system.model]


def test_dead_static_worker_is_retried_around_and_its_circuit_opens(system: System) -> None:
    with socket.socket() as sock:  # a port nobody listens on: connection refused
        sock.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sock.getsockname()[1]}"
    (gateway,) = start_parallel(system.cluster, [("gateway-static", [
        "launch-router", "--model-path", str(system.model_dir), "--port", "0", "--policy", "round_robin",
        "--breaker-failures", "2", "--breaker-cooldown", "60",
        "--worker", f"http://{system.colocated.address}", "--worker", dead])])
    client = system.client(gateway)
    for prompt in PROMPTS * 2:
        assert client.completions.create(model=system.model, prompt=prompt, max_tokens=4,
                                         temperature=0).choices
    assert gateway.metric("pdserve:gateway_retries_total") == 2  # the breaker opened after 2 failures
    assert gateway.metric("pdserve:gateway_worker_circuit_state", worker=dead) == 2  # open
    assert gateway.metric("pdserve:gateway_worker_circuit_state", worker=system.colocated.address) == 0
    gateway.kill(signal.SIGTERM)
    assert gateway.popen.returncode == 0


def test_worker_started_later_gets_traffic(system: System) -> None:
    (late,) = start_parallel(system.cluster,
                             [("prefill-2", worker_args(system.model_dir, "prefill", system.bootstrap))])
    system.prefills.append(late)
    wait_until(lambda: gateway_health(system)["workers"]["prefill"] == 3, 30, "the gateway to see prefill-2")
    client = system.client()
    for prompt in PROMPTS * 2:  # round robin over 3 prefill workers: prefill-2 gets 2 of 6
        assert client.completions.create(model=system.model, prompt=prompt, max_tokens=4,
                                         temperature=0).choices
    assert system.gateway.metric("pdserve:gateway_worker_requests_total", worker=late.address) >= 1
    assert late.metric("pdserve:prompt_tokens_total") > 0


def test_killing_a_prefill_under_load_is_invisible_to_clients(system: System) -> None:
    client = system.client()
    # long prompts (slow prefills), so requests are still queued on the victim when it dies
    prompts = [[3 + (i * 37 + k) % 4000 for k in range(1200)] for i in range(16)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        reference = list(pool.map(lambda prompt: system.client(system.reference).completions.create(
            model=system.model, prompt=prompt, max_tokens=6, temperature=0).choices[0].text, prompts))
    retries = system.gateway.metric("pdserve:gateway_retries_total")
    victim = system.prefills[0]

    def ask(index: int) -> tuple[int, str]:
        return index, client.completions.create(model=system.model, prompt=prompts[index], max_tokens=6,
                                                temperature=0).choices[0].text

    with ThreadPoolExecutor(max_workers=16) as pool:
        futures = [pool.submit(ask, i) for i in range(16)]
        wait_until(lambda: victim.metric("pdserve:prompt_tokens_total") > 0 or any(f.done() for f in futures),
                   30, "the victim to start prefilling")
        victim.kill(signal.SIGKILL)
        futures += [pool.submit(ask, i) for i in range(8)]  # it is still registered for a moment
        answers = [future.result() for future in futures]  # any client-visible error raises here
    assert all(text == reference[index] for index, text in answers)
    assert system.gateway.metric("pdserve:gateway_retries_total") > retries
