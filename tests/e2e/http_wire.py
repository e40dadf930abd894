"""Raw HTTP/1.1 on one keep-alive connection, for tests that must see what the server does to the
connection itself (kept after a 4xx, closed after a 413) and send bodies no client library sends."""

from __future__ import annotations

import http.client
import json
import socket
from dataclasses import dataclass


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    will_close: bool

    def json(self) -> dict:
        return json.loads(self.body)


class Wire:
    """One TCP connection to `host:port`; `request` sends raw bytes and reads one response."""

    def __init__(self, address: str, timeout_s: float = 60.0) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Wire:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read_answer(self) -> Answer:
        response = http.client.HTTPResponse(self.sock, method="POST")
        response.begin()
        body = response.read()
        headers = {name.lower(): value for name, value in response.getheaders()}
        return Answer(response.status, headers, body, response.will_close)

    def post(self, path: str, body: bytes, headers: dict[str, str] | None = None) -> Answer:
        self.send(request_bytes("POST", path, body, headers))
        return self.read_answer()

    def get(self, path: str, headers: dict[str, str] | None = None) -> Answer:
        self.send(request_bytes("GET", path, None, headers))
        return self.read_answer()

    def is_open(self) -> bool:
        """True if the server has not closed this connection (no EOF waiting to be read)."""
        self.sock.setblocking(False)
        try:
            return self.sock.recv(1, socket.MSG_PEEK) != b""
        except BlockingIOError:
            return True
        except OSError:
            return False
        finally:
            self.sock.setblocking(True)


def request_bytes(method: str, path: str, body: bytes | None, headers: dict[str, str] | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: gateway"]
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    if body is not None and "Transfer-Encoding" not in all_headers:
        all_headers.setdefault("Content-Length", str(len(body)))
    lines += [f"{name}: {value}" for name, value in all_headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body (an empty `data` ends the body)."""
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"
