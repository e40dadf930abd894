"""Remote media from public addresses only: a URL on an allowed domain whose host resolves to
loopback is a 400 unless the operator allows it, and the connection goes to the address that was
checked (no second lookup)."""

from __future__ import annotations

import asyncio
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpcore
import pytest

from services.gateway.errors import GatewayError
from services.gateway.media_fetch import MediaFetcher
from services.gateway.media_limits import MediaLimits
from services.gateway.public_addresses import NonPublicAddress, PublicOnlyBackend, is_public


class Image(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", "3")
        self.end_headers()
        self.wfile.write(b"png")

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def image_port():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Image)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def fetch(url: str, limits: MediaLimits) -> bytes:
    async def run() -> bytes:
        fetcher = MediaFetcher(limits)
        try:
            return await fetcher.fetch(url, "image 0", 1000, "too large", time.monotonic() + 10)
        finally:
            await fetcher.close()
    return asyncio.run(run())


@pytest.mark.parametrize("address, public", [
    ("127.0.0.1", False), ("10.1.2.3", False), ("192.168.0.1", False), ("172.16.5.5", False),
    ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False), ("224.0.0.1", False),
    ("::1", False), ("fe80::1%eth0", False), ("fd00::1", False), ("::ffff:127.0.0.1", False),
    ("8.8.8.8", True), ("2606:4700:4700::1111", True), ("::ffff:8.8.8.8", True)])
def test_public_addresses(address, public):
    assert is_public(address) is public


def test_an_allowed_domain_resolving_to_loopback_is_a_400(image_port):
    with pytest.raises(GatewayError) as raised:
        fetch(f"http://localhost:{image_port}/cat.png", MediaLimits(allowed_domains=("localhost",)))
    assert raised.value.status == 400
    assert any(f"localhost resolves to {address}" in raised.value.message for address in ("127.0.0.1", "::1"))
    assert "--allow-private-media-addresses" in raised.value.message
    # the operator's flag allows it
    limits = MediaLimits(allowed_domains=("localhost",), allow_private_addresses=True)
    assert fetch(f"http://localhost:{image_port}/cat.png", limits) == b"png"


class Recorder(httpcore.AsyncNetworkBackend):
    def __init__(self) -> None:
        self.hosts: list[str] = []

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        self.hosts.append(host)
        raise httpcore.ConnectError("recorded")


def test_the_connection_goes_to_the_checked_address_and_a_mixed_answer_is_refused():
    answers = {"cdn.example": ["93.184.216.34"], "rebind.example": ["93.184.216.34", "127.0.0.1"]}

    async def resolver(host: str, port: int) -> list[str]:
        return answers[host]

    recorder = Recorder()
    backend = PublicOnlyBackend(recorder, resolver)
    with pytest.raises(httpcore.ConnectError):
        asyncio.run(backend.connect_tcp("cdn.example", 443))
    assert recorder.hosts == ["93.184.216.34"]  # by address: no second lookup of the name
    with pytest.raises(NonPublicAddress, match="127.0.0.1"):
        asyncio.run(backend.connect_tcp("rebind.example", 443))
    assert recorder.hosts == ["93.184.216.34"]
