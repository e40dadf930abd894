"""Large bodies parsed in the pool (services/gateway/large_bodies.py): what the pool hands back, the
semaphore over bodies in memory, and the gateway's answers for large image bodies, in-process over ASGI
(no worker: a request that passed every check ends in 503 "no healthy workers")."""

from __future__ import annotations

import asyncio
import base64
import glob
import json
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from services.gateway.large_bodies import (
    LARGE_BODY_BYTES,
    LARGE_STRING_CHARS,
    PLACEHOLDER_SCHEME,
    SPOOL_DIR,
    DecodedImages,
    LargeBodies,
    LargeBodyRequest,
    parse_body,
    sweep_dead_folders,
)
from services.gateway.state import build_state

BIG = os.urandom(LARGE_BODY_BYTES)  # its base64 is over the large-body size on its own
SMALL = b"\x89PNG small"


def data_url(blob: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(blob).decode()


def chat(*urls: str) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    content = [*parts, {"type": "text", "text": "?"}]
    return {"model": "tiny-vl", "messages": [{"role": "user", "content": content}]}


def test_parse_body_decodes_large_images_and_leaves_the_rest():
    bad_mime = data_url(BIG, "text/plain")
    body = chat(data_url(BIG), data_url(SMALL), bad_mime, "data:image/png;base64," + "*" * LARGE_STRING_CHARS)
    body["image_data"] = [base64.b64encode(BIG).decode(), ["/etc/passwd." * 10_000]]
    value, decoded = parse_body(json.dumps(body).encode(), "n0nce")
    urls = [part["image_url"]["url"] for part in value["messages"][0]["content"][:4]]
    assert urls[0] == f"{PLACEHOLDER_SCHEME}:n0nce/0" and decoded[urls[0]] == BIG
    assert urls[1:3] == [data_url(SMALL), bad_mime]  # small; not an image type: left for the loop's checks
    assert decoded[urls[3]] is None  # an image type whose payload is not base64: refused later as such
    bare = value["image_data"][0]
    assert bare == f"{PLACEHOLDER_SCHEME}:n0nce/2" and decoded[bare] == BIG
    assert value["image_data"][1] == ["/etc/passwd." * 10_000]  # not base64: left for the loop's message
    with pytest.raises(json.JSONDecodeError):
        parse_body(b'{"messages": [' + b" " * LARGE_BODY_BYTES, "n0nce")


async def test_large_bodies_wait_for_a_slot_before_they_are_read():
    bodies = LargeBodies(processes=1, max_bodies=1)
    reads: list[str] = []
    release = asyncio.Event()

    def request(name: str) -> LargeBodyRequest:
        async def receive() -> dict:
            reads.append(name)
            await release.wait()
            return {"type": "http.request", "body": b"{}", "more_body": False}

        scope = {"type": "http", "method": "POST", "path": "/", "headers": [
            (b"content-length", str(LARGE_BODY_BYTES).encode())]}
        from starlette.requests import Request
        return LargeBodyRequest(Request(scope, receive), bodies)

    first, second = request("first"), request("second")
    first_body = asyncio.create_task(first.body())
    second_body = asyncio.create_task(second.body())
    for _ in range(5):
        await asyncio.sleep(0)
    assert reads == ["first"]  # the second waits for the slot, its bytes still on the socket
    release.set()
    assert await first_body == b"{}"
    first.release()
    assert await second_body == b"{}" and reads == ["first", "second"]
    second.release()
    assert not bodies.slots.locked()


@pytest.fixture(scope="module")
def tiny_vl(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint's gateway files, marked as a vision-language model's: the gateway reads
    only the config's vision_config to take images (writing a real tiny-vl checkpoint takes 40 s)."""
    folder = tmp_path_factory.mktemp("gateway") / "tiny-vl"
    shutil.copytree(tiny_model, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vision_config": {}}))
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
        "{{ '<|image_pad|>' if p.type == 'image' else p.text }}{% endfor %}{% endif %}{% endfor %}")
    return folder


@pytest.fixture
async def client(tiny_vl: Path) -> AsyncIterator[httpx.AsyncClient]:
    state = build_state(GatewayConfig(model_path=str(tiny_vl), max_image_bytes=3 * LARGE_BODY_BYTES // 2))
    app = create_app(state)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=60) as http:
        yield http
    app.state.large_bodies.close()
    state.pool.close()


async def test_large_image_bodies_through_the_gateway(client: httpx.AsyncClient):
    path = "/v1/chat/completions"
    # a valid image in a large body passes every check (no worker: 503), as the same image does in a small one
    answer = await client.post(path, json=chat(data_url(BIG)))
    assert answer.status_code == 503, answer.text
    answer = await client.post("/generate", json={"model": "tiny-vl", "text": "<|image_pad|>",
                                                  "image_data": base64.b64encode(BIG).decode()})
    assert answer.status_code == 503, answer.text
    refusals = [
        (chat(data_url(BIG), f"{PLACEHOLDER_SCHEME}:0000000000000000/0"), 400,
         "image 1: expected a data: URL, an http(s) URL"),  # a client's own placeholder is no image
        (chat("data:image/png;base64," + "*" * LARGE_BODY_BYTES), 400,
         "image 0: the data is not valid base64"),
        (chat(data_url(BIG + BIG)), 413, "--max-image-bytes"),
    ]
    for body, status, message in refusals:
        response = await client.post(path, json=body)
        assert (response.status_code, message in response.json()["error"]["message"]) == (status, True), \
            response.text
    malformed = json.dumps(chat(data_url(BIG))).encode()[:-2]
    response = await client.post(path, content=malformed, headers={"content-type": "application/json"})
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"], response.text
    assert not glob.glob(f"{SPOOL_DIR}/pdserve-body-{os.getpid()}-*")  # every body and image file removed


def _folders(pid: int) -> list[str]:
    return glob.glob(f"{SPOOL_DIR}/pdserve-body-{pid}-*")


async def test_a_parse_cancelled_mid_way_leaves_no_files():
    """A client that disconnects while its body is in the pool cancels the gateway's wait, not the
    pool's work: the pool's image files, written after the cancel, must not stay in /dev/shm."""
    bodies = LargeBodies(processes=1)
    try:
        await bodies.parse(b"{}")  # the pool process started, so the big body's parse is the slow part
        body = json.dumps(chat(*[data_url(os.urandom(4 * LARGE_BODY_BYTES)) for _ in range(2)])).encode()
        parse = asyncio.create_task(bodies.parse(body))
        seen = False
        for _ in range(2000):  # until the pool took the body (read and removed it): it is parsing now
            waiting = [p for p in glob.glob(f"{SPOOL_DIR}/pdserve-body-{os.getpid()}-*")
                       if os.path.isfile(p) or os.path.isfile(f"{p}/body")]
            if seen and not waiting:
                break
            seen = seen or bool(waiting)
            await asyncio.sleep(0.002)
        parse.cancel()
        with pytest.raises(asyncio.CancelledError):
            await parse
        assert not _folders(os.getpid())
        assert await bodies.parse(b"[1]") == ([1], DecodedImages())  # runs once the cancelled parse ended
        assert not _folders(os.getpid())
        # (the same pool) its processes run only where the gateway's streams leave a core idle
        policy = await asyncio.wrap_future(bodies._executor().submit(os.sched_getscheduler, 0))
        assert policy == os.SCHED_IDLE
    finally:
        bodies.close()


def test_folders_of_dead_gateways_are_swept(tmp_path: Path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    left = tmp_path / f"pdserve-body-{dead_pid}-00ff"
    left.mkdir()
    (left / "body.0").write_bytes(b"image")
    (tmp_path / f"pdserve-body-{dead_pid}-11ee").write_bytes(b"an old-style body file")
    mine = tmp_path / f"pdserve-body-{os.getpid()}-22dd"
    mine.mkdir()
    other = tmp_path / "pdserve-bodyguard"
    other.write_bytes(b"not ours")
    swept = sweep_dead_folders(str(tmp_path))
    assert sorted(swept) == sorted([str(left), str(tmp_path / f"pdserve-body-{dead_pid}-11ee")])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, other.name])


async def _post_in_chunks(app, body: bytes, then: dict | None, chunk: int = 256 * 1024) -> list[dict]:
    """POST `body` to the app over ASGI in chunks with its Content-Length, and after the chunks `then`
    (None: the rest of the body never comes); the messages the app sent back."""
    chunks = [body[i:i + chunk] for i in range(0, len(body), chunk)]
    messages = [{"type": "http.request", "body": part, "more_body": True} for part in chunks]
    messages.append(then or {})
    folders_seen = []

    async def receive() -> dict:
        folders_seen.append(bool(_folders(os.getpid())))
        message = messages.pop(0) if messages else {}
        if not message:
            await asyncio.sleep(3600)  # a client that stopped sending
        return message

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    path = "/v1/chat/completions"
    scope = {"type": "http", "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "server": ("gateway", 80), "client": ("127.0.0.1", 1), "app": app,
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body) + 10).encode())]}
    await app(scope, receive, send)
    assert any(folders_seen[2:])  # the body was being written to its folder while it arrived
    return sent


async def test_a_body_cut_short_leaves_no_files(tiny_vl: Path):
    """A declared-length body is written to its request's folder as it arrives; a client that
    disconnects mid-body, or stops sending until the read deadline (408), leaves no folder and frees
    its large-body slot."""
    state = build_state(GatewayConfig(model_path=str(tiny_vl), max_image_bytes=3 * LARGE_BODY_BYTES // 2,
                                      body_read_timeout=1.0))
    app = create_app(state)
    body = json.dumps(chat(data_url(BIG))).encode()
    try:
        async with app.router.lifespan_context(app):
            await _post_in_chunks(app, body, {"type": "http.disconnect"})
            assert not _folders(os.getpid())
            sent = await _post_in_chunks(app, body, None)
            assert sent[0]["status"] == 408, sent
            assert not _folders(os.getpid())
            bodies: LargeBodies = app.state.large_bodies
            assert bodies.slots._value == 4  # every slot given back
    finally:
        app.state.large_bodies.close()
        state.pool.close()
