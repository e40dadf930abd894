"""EPD: an encoder service (`--encoder-only`) ships image embeddings to a `--language-only` worker over
mooncake and nixl, as real processes behind a gateway, driven by the official openai client. The
language-only worker is a colocated one, or the prefill of a PD pair (1 encoder, 1 prefill, 1 decode).

Greedy fp32 output equals transformers' Qwen2VLForConditionalGeneration for text + 1 image, text + 2
images of different sizes and an image alone; the same image twice is encoded once (embedding cache
hit in the worker's metrics); the encoder refuses forged calls before writing anything; an encoder
frozen or killed mid-request costs a retry on another encoder, or a clear 503 when none is left,
and every embedding and KV page is idle afterwards. On mooncake the colocated worker finds its encoder
at --encoder-urls, on nixl (and in PD) through the registry.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.cluster import Cluster, Proc, wait_until, worker_args
from tests.e2e.test_vl_chat import chat, data_url, hf_reference, image, router

pytestmark = [pytest.mark.e2e, pytest.mark.alone, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Epd:
    model_dir: Path
    gateway: Proc
    worker: Proc  # the language-only worker: colocated, or the prefill of a PD pair
    encoders: list[Proc]
    backend: str
    decode: Proc | None = None  # PD: the decode worker (it keeps its tower, for a retraction only)

    def client(self, gateway: Proc) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", max_retries=0,
                             timeout=120)


def encoder_args(model_dir: Path, backend: str, bootstrap: Proc | None = None) -> list[str]:
    args = ["launch-server", "--model-path", str(model_dir), "--encoder-only", "--port", "0",
            "--metrics-port", "0", "--num-threads", "1", "--encoder-transfer-backend", backend]
    return args + (["--bootstrap", bootstrap.address] if bootstrap else [])


def language_only_args(model_dir: Path, backend: str, encoders: list[Proc], bootstrap: Proc | None = None,
                       timeout_s: float = 30.0, mode: str = "null") -> list[str]:
    extra = ["--language-only", "--encoder-transfer-backend", backend, "--num-pages", "256",
             "--encoder-timeout", str(timeout_s)]
    if encoders:
        extra += ["--encoder-urls", *(f"http://{e.address}" for e in encoders)]
    kv_backend = backend if mode != "null" else "fake"
    return worker_args(str(model_dir), mode, backend=kv_backend, bootstrap=bootstrap, extra=tuple(extra))


def start_gateway(cluster: Cluster, model_dir: Path, worker: Proc) -> Proc:
    gateway = cluster.start("gateway", router(model_dir, worker), timeout_s=60)
    wait_until(lambda: httpx.get(f"http://{gateway.address}/health", timeout=5).status_code == 200, 30,
               "the gateway to be ready")
    return gateway


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tools.models.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-vl", preset="tiny-vl", seed=0)


def start_pd(cluster: Cluster, model_dir: Path, backend: str) -> Epd:
    """1 encoder, 1 language-only prefill, 1 decode, a gateway: all through the registry."""
    bootstrap = cluster.bootstrap()
    encoder = cluster.start("encoder", encoder_args(model_dir, backend, bootstrap))
    prefill, decode = cluster.start_many([
        ("prefill", language_only_args(model_dir, backend, [], bootstrap, mode="prefill")),
        ("decode", worker_args(str(model_dir), "decode", backend=backend, bootstrap=bootstrap,
                               extra=("--num-pages", "256")))])
    gateway = cluster.start("gateway", ["launch-router", "--model-path", str(model_dir), "--port", "0",
                                        "--bootstrap", bootstrap.address], timeout_s=60)
    epd = Epd(model_dir, gateway, prefill, [encoder], backend, decode)

    def serves() -> bool:
        try:
            chat(epd, gateway, ["hello"], [])
            return True
        except openai.APIError:
            return False

    wait_until(serves, 60, "the gateway to serve through prefill and decode")
    return epd


def start_colocated(cluster: Cluster, model_dir: Path, backend: str) -> Epd:
    """1 encoder, 1 language-only colocated worker, a gateway. On mooncake the worker is given the
    encoder (--encoder-urls), on nixl it finds it in the registry."""
    if backend == "mooncake":
        encoder = cluster.start("encoder", encoder_args(model_dir, backend))
        worker = cluster.start("worker", language_only_args(model_dir, backend, [encoder]))
    else:
        bootstrap = cluster.bootstrap()
        encoder = cluster.start("encoder", encoder_args(model_dir, backend, bootstrap))
        worker = cluster.start("worker", language_only_args(model_dir, backend, [], bootstrap))
    return Epd(model_dir, start_gateway(cluster, model_dir, worker), worker, [encoder], backend)


# Colocated EPD and EPD under PD, each backend once, in `make test`; the other two in `make test-all`.
@pytest.fixture(scope="module", params=[pytest.param("mooncake", marks=pytest.mark.long), "nixl",
                                        "pd-mooncake", pytest.param("pd-nixl", marks=pytest.mark.long)])
def epd(request, vl_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Epd]:
    backend = request.param.removeprefix("pd-")
    with Cluster(tmp_path_factory.mktemp(f"epd-{request.param}")) as cluster:
        try:
            yield start_pd(cluster, vl_model, backend) if request.param.startswith("pd-") \
                else start_colocated(cluster, vl_model, backend)
        except BaseException:
            print(cluster.logs())
            raise


def assert_idle(worker: Proc, *others: Proc) -> None:
    wait_until(lambda: worker.metric("pdserve:embedding_pages_used") == 0, 30, "embedding pages to be free")
    for proc in (worker, *others):
        wait_until(lambda proc=proc: proc.metric("pdserve:kv_pages_used") == 0, 30,
                   f"{proc.name}'s KV pages to be free")


@pytest.mark.parametrize(("parts", "pictures"), [
    (["Look at", None, "what is it?"], [(130, 90, 1)]),
    (["compare", None, "with", None], [(60, 200, 2), (100, 100, 3)]),
    ([None], [(120, 80, 4)]),
], ids=["text+1 image", "text+2 images", "image alone"])
def test_epd_matches_transformers(epd: Epd, parts, pictures):
    images = [image(*p) for p in pictures]
    answer = chat(epd, epd.gateway, parts, [data_url(i) for i in images])
    assert answer.choices[0].message.content == hf_reference(epd.model_dir, parts, images)
    assert_idle(epd.worker, *([epd.decode] if epd.decode else []))
    if epd.decode is not None:  # the prompt ran on the language-only prefill, not on decode
        assert epd.worker.metric("pdserve:embedding_cache_misses_total") > 0


def test_same_image_twice_is_encoded_once(epd: Epd):
    url = data_url(image(90, 70, 11))
    kv_workers = [epd.worker, *([epd.decode] if epd.decode else [])]

    def prefix_hits() -> float:
        return sum(w.metric("pdserve:prefix_cache_hit_tokens_total") for w in kv_workers)

    hits = epd.worker.metric("pdserve:embedding_cache_hits_total")
    encoded = epd.encoders[0].metric("pdserve:encoder_images_total")
    first = chat(epd, epd.gateway, ["describe", None], [url]).choices[0].message.content
    prefix = prefix_hits()
    second = chat(epd, epd.gateway, ["describe", None], [url]).choices[0].message.content
    assert first == second
    assert prefix_hits() > prefix  # the image's digest salts its pages' hashes: the same image hits them
    assert epd.worker.metric("pdserve:embedding_cache_hits_total") == hits + 1
    assert epd.encoders[0].metric("pdserve:encoder_images_total") == encoded + 1
    assert epd.encoders[0].metric("pdserve:encoder_embedding_bytes_total") > 0


def test_forged_encoder_calls_are_refused_before_writing(epd: Epd, tmp_path: Path):
    path = tmp_path / "picture.png"
    image(64, 64, 12).save(path)  # the tiny-vl processor makes 4 embedding rows of it
    run = subprocess.run(
        [sys.executable, "-m", "tests.e2e.epd_caller", epd.encoders[0].address, epd.backend, "tiny-vl",
         str(path), "4"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == {"forged_grant": "PERMISSION_DENIED", "ungranted_pages": "PERMISSION_DENIED",
                      "untouched": True, "landed": True}


def test_frozen_or_killed_encoder_means_retry_then_503(vl_model: Path,
                                                       tmp_path_factory: pytest.TempPathFactory):
    """Two encoders; one frozen (SIGSTOP): every request still succeeds, those sent to it after one
    retry on the other. The other killed (SIGKILL) too: a 503 that says why. Pages idle after each."""
    backend = "mooncake"
    with Cluster(tmp_path_factory.mktemp("epd-faults")) as cluster:
        try:
            frozen, killed = cluster.start_many([("encoder-a", encoder_args(vl_model, backend)),
                                                 ("encoder-b", encoder_args(vl_model, backend))])
            worker = cluster.start("worker", language_only_args(vl_model, backend, [frozen, killed],
                                                                timeout_s=5))
            epd = Epd(vl_model, start_gateway(cluster, vl_model, worker), worker, [frozen, killed], backend)
            frozen.send(signal.SIGSTOP)
            for seed in (21, 22):  # round robin: one of them goes to the frozen encoder first
                answer = chat(epd, epd.gateway, ["what", None], [data_url(image(64, 48, seed))])
                assert answer.usage.completion_tokens > 0
            assert_idle(worker)
            killed.kill(signal.SIGKILL)
            with pytest.raises(openai.APIStatusError) as raised:
                chat(epd, epd.gateway, ["what", None], [data_url(image(64, 48, 23))])
            assert raised.value.status_code == 503
            assert "encoder" in json.dumps(raised.value.body), raised.value.body
            assert_idle(worker)
            frozen.send(signal.SIGCONT)  # back: it refuses the stale calls it finds queued (grants released)
            answer = chat(epd, epd.gateway, ["what", None], [data_url(image(64, 48, 24))])
            assert answer.usage.completion_tokens > 0
            assert_idle(worker)
        except BaseException:
            print(cluster.logs())
            raise
