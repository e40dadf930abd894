"""The gateway's image input beyond inline data: URLs: remote URLs on --allowed-media-domains
(fetched with time, byte and redirect limits), per-request limits, /generate's image_data, and bad
input of every kind. Real processes: a gateway in front of a colocated tiny-vl worker (small image
limits, 127.0.0.1 allowed), one in front of a text-only tiny worker, and a local HTTP server on
127.0.0.1 that serves an image, hangs, sends too many bytes, redirects elsewhere or sends text.
Each bad input answers 4xx with a message, never 500; afterwards the worker's KV pages are free
and its peak memory did not grow by a decoded image's size.
"""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.e2e.cluster import Cluster, Proc, wait_until, worker_args
from tests.e2e.http_wire import Wire, chunk, request_bytes

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
NEW = 6
IMAGE_BYTES = 300_000  # --max-image-bytes of the VL gateway
REQUEST_IMAGE_BYTES = 500_000  # its --max-request-image-bytes
PAD = "<|vision_start|><|image_pad|><|vision_end|>"


def png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


CAT = png(64, 48, 1)


def data_url(blob: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(blob).decode()


class ImageServer(BaseHTTPRequestHandler):
    """/cat.png an image; /hang sends nothing until the test ends; /big an endless image/png body
    without a length; /away a redirect to a host that is not allowed; /hop a redirect to /cat.png;
    /page an HTML page."""

    release = threading.Event()

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/cat.png":
            self._send(200, "image/png", CAT)
        elif self.path == "/hang":
            self.release.wait(120)
        elif self.path == "/big":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            try:
                for _ in range(100):  # 10 MB at most, far past the limit
                    self.wfile.write(b"\0" * 100_000)
            except OSError:
                pass  # the gateway hung up once it had too many bytes
        elif self.path == "/away":
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_address[1]}/cat.png")
            self.end_headers()
        elif self.path == "/hop":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.end_headers()
        else:
            self._send(200, "text/html", b"<html>not an image</html>")

    def _send(self, status: int, kind: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@dataclass
class Servers:
    vl: Proc
    text: Proc
    vl_worker: Proc
    images: str  # http://127.0.0.1:PORT of the image server

    def client(self, gateway: Proc) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", max_retries=0,
                             timeout=120)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    from tools.models.tiny_model import write_tiny_model

    vl_dir = write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-vl", preset="tiny-vl", seed=0)
    text_dir = write_tiny_model(tmp_path_factory.mktemp("model") / "tiny", preset="tiny", seed=0)
    http = ThreadingHTTPServer(("127.0.0.1", 0), ImageServer)
    http.daemon_threads = True
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        with Cluster(tmp_path_factory.mktemp("vl-media")) as cluster:
            try:
                vl_worker, text_worker = cluster.start_many([
                    ("vl-worker", worker_args(str(vl_dir), "null", extra=("--num-pages", "256"))),
                    ("text-worker", worker_args(str(text_dir), "null", extra=("--num-pages", "256")))], 180)
                vl, text = cluster.start_many([
                    ("gateway-vl", ["launch-router", "--model-path", str(vl_dir), "--port", "0",
                                    "--worker", f"http://{vl_worker.address}",
                                    "--allowed-media-domains", "127.0.0.1", "example.invalid",
                                    "--allow-private-media-addresses",  # the image server is local
                                    "--media-fetch-timeout", "3", "--limit-mm-per-prompt", '{"image": 4}',
                                    "--max-image-bytes", str(IMAGE_BYTES),
                                    "--max-request-image-bytes", str(REQUEST_IMAGE_BYTES)]),
                    ("gateway-text", ["launch-router", "--model-path", str(text_dir), "--port", "0",
                                      "--worker", f"http://{text_worker.address}"])], 60)
                for gateway in (vl, text):
                    wait_until(lambda g=gateway:
                               httpx.get(f"http://{g.address}/health", timeout=5).status_code == 200,
                               30, f"{gateway.name} to be ready")
                yield Servers(vl, text, vl_worker, f"http://127.0.0.1:{http.server_address[1]}")
            except BaseException:
                print(cluster.logs())
                raise
            finally:
                ImageServer.release.set()
    finally:
        http.shutdown()
        http.server_close()


def model_of(gateway: Proc) -> str:
    return httpx.get(f"http://{gateway.address}/v1/models", timeout=5).json()["data"][0]["id"]


def chat(servers: Servers, gateway: Proc, urls: list[str], text: str = "what is this?"):
    content = ([{"type": "image_url", "image_url": {"url": url}} for url in urls]
               + [{"type": "text", "text": text}])
    return servers.client(gateway).chat.completions.create(
        model=model_of(gateway), messages=[{"role": "user", "content": content}], max_tokens=NEW,
        temperature=0, extra_body={"ignore_eos": True})


def generate(servers: Servers, body: dict) -> httpx.Response:
    body = {"sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}, **body}
    return httpx.post(f"http://{servers.vl.address}/generate", json=body, timeout=120)


def refused(servers: Servers, urls: list[str], status: int, match: str, gateway: Proc | None = None) -> None:
    with pytest.raises(openai.APIStatusError) as raised:
        chat(servers, gateway or servers.vl, urls)
    error = raised.value
    assert (error.status_code, match in error.body["message"]) == (status, True), error.body


def test_allowed_remote_url_is_fetched(servers):
    inline = chat(servers, servers.vl, [data_url(CAT)]).choices[0].message.content
    assert chat(servers, servers.vl, [f"{servers.images}/cat.png"]).choices[0].message.content == inline
    assert chat(servers, servers.vl, [f"{servers.images}/hop"]).choices[0].message.content == inline


def test_remote_url_failures_are_400_or_413(servers):
    refused(servers, [f"{servers.images}/away"], 400,
            "the domain localhost is not in --allowed-media-domains")
    refused(servers, [f"{servers.images}/page"], 400, "is not an image (content type text/html)")
    refused(servers, [f"{servers.images}/big"], 413, "--max-image-bytes")
    refused(servers, ["http://example.invalid/cat.png"], 400, "example.invalid/cat.png")  # no such host
    refused(servers, ["https://example.com/cat.png"], 400,
            "the domain example.com is not in --allowed-media-domains")
    refused(servers, ["https://example.com/cat.png"], 400, "images sent to a text-only model", servers.text)


def test_a_hanging_server_holds_only_its_request(servers):
    answer: dict = {}

    def hanging() -> None:
        try:
            chat(servers, servers.vl, [f"{servers.images}/hang"])
        except openai.APIStatusError as exc:
            answer["error"] = exc

    thread = threading.Thread(target=hanging)
    thread.start()
    # served while the other request waits on the hanging server
    assert chat(servers, servers.vl, [data_url(CAT)]).usage.completion_tokens == NEW
    thread.join(120)
    error = answer["error"]
    assert (error.status_code == 400
            and "not fetched within 3s (--media-fetch-timeout)" in error.body["message"])


def test_generate_takes_image_data(servers):
    prompt = f"{PAD}describe"
    outputs = []
    for image in (base64.b64encode(CAT).decode(), data_url(CAT), f"{servers.images}/cat.png"):
        for form in (image, [image]):
            response = generate(servers, {"text": prompt, "image_data": form})
            assert response.status_code == 200, response.text
            outputs.append(response.json()["text"])
    assert len(set(outputs)) == 1
    batch = generate(servers, {"text": [prompt, "no image"], "image_data": [data_url(CAT), None]})
    assert batch.status_code == 200, batch.text
    assert batch.json()[0]["text"] == outputs[0]


@pytest.mark.parametrize(("body", "status", "match"), [
    ({"image_data": "/etc/passwd"}, 400, "local files are not read"),
    ({"image_data": "file:///etc/passwd"}, 400, "got a file: URL"),
    ({"image_data": "https://example.com/x.png"}, 400, "example.com is not in --allowed-media-domains"),
    ({"image_data": [[data_url(CAT)]]}, 400, "a string or a list of strings"),
    ({"text": ["a", "b"], "image_data": [data_url(CAT)]}, 400, "one entry per prompt"),
    ({"image_data": [data_url(CAT)] * 5}, 400, "at most 4 (--limit-mm-per-prompt)"),
    ({"image_data": data_url(b"\0" * (IMAGE_BYTES + 1))}, 413, "--max-image-bytes"),
    ({"image_data": [data_url(CAT)] * 2}, 400, "1 image placeholders but 2 images"),
    ({"image_data": base64.b64encode(b"not an image").decode()}, 400, "is not a PNG, JPEG or WebP image"),
])
def test_generate_refuses_bad_image_data(servers, body, status, match):
    response = generate(servers, {"text": f"{PAD}describe", **body})
    assert (response.status_code, match in response.json()["error"]["message"]) == (status, True), \
        response.text


def huge_data_url_is_413(servers: Servers) -> None:
    """A data URL past the body limit (text room + the request's image bytes as base64), sent as a
    client streams it: refused with 413 as soon as the body passes the limit, naming both flags."""
    limit = (2 << 20) + 4 * -(-REQUEST_IMAGE_BYTES // 3)
    start = (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": '
             b'{"url": "data:image/png;base64,')
    with Wire(servers.vl.address) as wire:
        wire.send(request_bytes("POST", "/v1/chat/completions", b"", {"Transfer-Encoding": "chunked"}))
        wire.send(chunk(start))
        for _ in range(3):  # 3 MiB of base64; the end of the body never comes
            wire.send(chunk(b"A" * (1 << 20)))
        answer = wire.read_answer()
    message = answer.json()["error"]["message"]
    assert answer.status == 413 and f"larger than the limit of {limit} bytes" in message, message
    assert "--max-request-image-bytes" in message


def peak_rss(proc: Proc) -> int:
    """The process's peak resident memory (VmHWM), bytes: a decoded 50-megapixel image would raise it."""
    for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_bad_input_is_4xx_and_leaves_the_worker_as_it_was(servers):
    chat(servers, servers.vl, [data_url(CAT)])  # warm: the first image request's allocations
    before = peak_rss(servers.vl_worker)
    raw = png(64, 64, 2)
    big = io.BytesIO()
    Image.new("RGB", (10000, 5000), (10, 20, 30)).save(big, format="PNG")  # 50 megapixels, small as a PNG
    for _ in range(2):
        refused(servers, ["data:image/png;base64," + base64.b64encode(b"not an image").decode()], 400,
                "is not a PNG, JPEG or WebP image")
        refused(servers, [data_url(raw[: len(raw) // 2])], 400, "truncated or corrupt")
        refused(servers, [data_url(big.getvalue())], 400, "pixels; at most")
        refused(servers, [data_url(CAT)] * 100, 400, "100 images in one request; at most 4")
        refused(servers, [data_url(b"\0" * 200_000)] * 3, 413, "--max-request-image-bytes")
        huge_data_url_is_413(servers)
        refused(servers, ["https://example.com/cat.png"], 400, "not in --allowed-media-domains")
        refused(servers, [data_url(CAT)], 400, "images sent to a text-only model", servers.text)
    wait_until(lambda: servers.vl_worker.metric("pdserve:kv_pages_used") == 0, 30,
               "the worker's pages to be free")
    grown = peak_rss(servers.vl_worker) - before
    assert grown < 100 << 20, f"the worker's peak RSS grew by {grown} bytes (a decoded 50 MP image is 150 MB)"
    assert "Traceback" not in servers.vl.log() + servers.text.log()
