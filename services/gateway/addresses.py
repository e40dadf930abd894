"""Worker addresses as operators write them, reduced to the gRPC `host:port` the gateway dials.

The seeds' router takes `http://127.0.0.1:30000`; pdserve workers speak gRPC on that port, so
`http://H:P`, `https://H:P`, `grpc://H:P` and plain `H:P` all name the same thing: the worker's
gRPC address `H:P`. IPv6 hosts are written in brackets (`[::1]:30000`).
"""

from __future__ import annotations

from urllib.parse import urlsplit

_SCHEMES = ("http", "https", "grpc")


def grpc_address(url: str) -> str:
    """`http://127.0.0.1:30000/` -> `127.0.0.1:30000`. Raises ValueError without a host and port."""
    text = url.strip()
    if "://" not in text:
        text = "grpc://" + text
    parts = urlsplit(text)
    if parts.scheme not in _SCHEMES:
        raise ValueError(f"worker address {url!r}: scheme must be one of {_SCHEMES}, got {parts.scheme!r}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"worker address {url!r}: expected scheme://host:port with no path")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"worker address {url!r}: {exc}") from None
    if not parts.hostname or port is None:
        raise ValueError(f"worker address {url!r}: expected host:port (e.g. http://127.0.0.1:30000)")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{port}"
