"""The seeds' router command line, verbatim but for free ports: no --model-path.

`launch-router --pd-disaggregation --prefill URL BOOTSTRAP_PORT --decode URL --policy round_robin ...`
with real prefill and decode workers (mooncake): the gateway learns tokenizer, chat template, context
length and served name from the workers over gRPC (GetModelInfo), serves chat output equal to a
colocated reference (a gateway given --model-path), and refuses two other workers it was given: one
serving another name, one serving the same name with another tokenizer.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.cluster import Cluster, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.alone, pytest.mark.timeout(400)]

CHAT = [{"role": "user", "content": "Tell me about the river."}]


def _worker(model: Path, mode: str, *extra: str) -> list[str]:
    return ["launch-server", "--model-path", str(model), "--disaggregation-mode", mode, "--port", "0",
            "--metrics-port", "0", "--disaggregation-transfer-backend", "mooncake", "--num-threads", "1",
            "--num-pages", "128", *extra]


def _chat_stream(address: str, model: str, content: str) -> str:
    client = openai.OpenAI(base_url=f"http://{address}/v1", api_key="unused", max_retries=0, timeout=120)
    chunks = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                            max_tokens=20, temperature=0, stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)


def test_seed_router_command_learns_model_from_workers(cluster: Cluster, tiny_model: Path,
                                                       tmp_path: Path) -> None:
    from tools.models.tiny_model import write_tiny_model

    # same folder name (so the same default served name), another tokenizer
    other_tokenizer = write_tiny_model(tmp_path / "other" / tiny_model.name, preset="tiny", seed=0,
                                       tokenizer_vocab_size=1024)
    prefill, decode, reference_worker, renamed, retokenized = cluster.start_many([
        ("prefill", _worker(tiny_model, "prefill")),
        ("decode", _worker(tiny_model, "decode")),
        ("colocated", _worker(tiny_model, "null")),
        ("renamed", _worker(tiny_model, "null", "--model-name", "another-name")),
        ("retokenized", _worker(other_tokenizer, "null"))])
    gateway, reference = cluster.start_many([
        ("gateway", ["launch-router", "--pd-disaggregation", "--prefill", f"http://{prefill.address}", "8998",
                     "--decode", f"http://{decode.address}", "--worker", f"http://{renamed.address}",
                     "--worker", f"http://{retokenized.address}", "--policy", "round_robin",
                     "--host", "127.0.0.1", "--port", "0"]),
        ("gateway-ref", ["launch-router", "--model-path", str(tiny_model), "--port", "0",
                         "--worker", f"http://{reference_worker.address}"])])

    def health() -> httpx.Response:
        return httpx.get(f"http://{gateway.address}/health", timeout=5)

    wait_until(lambda: health().status_code == 200, 60, "the gateway to become healthy")
    wait_until(lambda: gateway.log().count("refusing colocated") == 2, 30,
               "the gateway to refuse two workers")
    log = gateway.log()
    assert (f"refusing colocated {renamed.address}: it serves model 'another-name', "
            "this gateway serves 'tiny'") in log
    assert f"refusing colocated {retokenized.address}: its tokenizer files differ" in log
    assert health().json() == {"status": "ok", "model": "tiny",
                               "workers": {"prefill": 1, "decode": 1, "colocated": 0}}
    models = httpx.get(f"http://{gateway.address}/v1/models", timeout=5).json()
    assert [entry["id"] for entry in models["data"]] == ["tiny"]

    for content in ("Tell me about the river.", "Write a poem about the sea, please."):
        pd_text = _chat_stream(gateway.address, "tiny", content)
        assert pd_text and pd_text == _chat_stream(reference.address, "tiny", content)
    assert decode.metric("pdserve:request_success_total") == 2  # served by PD, not by the refused workers
    for refused in (renamed, retokenized):
        assert refused.metric("pdserve:request_success_total") == 0


def test_gateway_without_model_or_workers_says_what_it_needs(cluster: Cluster) -> None:
    proc = cluster.spawn("gateway", ["launch-router", "--port", "0"])
    assert proc.popen.wait(timeout=60) == 2
    assert "give --model-path, or workers" in proc.log()


def test_registry_worker_with_another_tokenizer_is_refused(cluster: Cluster, tiny_model: Path,
                                                           tmp_path: Path) -> None:
    """Given only the registry, the gateway learns the model from its workers and admits a worker
    that joins later only if it reports the same model: same name, other tokenizer is refused."""
    from tools.models.tiny_model import write_tiny_model

    other_tokenizer = write_tiny_model(tmp_path / "other" / tiny_model.name, preset="tiny", seed=0,
                                       tokenizer_vocab_size=1024)
    bootstrap = cluster.bootstrap("--heartbeat-interval", "1")
    cluster.start_many([("prefill", _worker(tiny_model, "prefill", "--bootstrap", bootstrap.address)),
                        ("decode", _worker(tiny_model, "decode", "--bootstrap", bootstrap.address))])
    gateway = cluster.start("gateway", ["launch-router", "--bootstrap", bootstrap.address, "--port", "0"])
    wait_until(lambda: httpx.get(f"http://{gateway.address}/health", timeout=5).status_code == 200, 60,
               "the gateway to admit the prefill and decode workers")
    retokenized = cluster.start("retokenized", _worker(other_tokenizer, "null",
                                                       "--bootstrap", bootstrap.address))
    wait_until(lambda: f"refusing colocated {retokenized.address}" in gateway.log(), 30,
               "the gateway to refuse the worker with another tokenizer")
    assert "its tokenizer files differ" in gateway.log()
    time.sleep(2)  # two more heartbeats of the refused worker: it stays out
    health = httpx.get(f"http://{gateway.address}/health", timeout=5).json()
    assert health["workers"] == {"prefill": 1, "decode": 1, "colocated": 0}
    assert gateway.log().count(f"refusing colocated {retokenized.address}") == 1
    assert _chat_stream(gateway.address, "tiny", "Hello!")
