#!/usr/bin/env python3
"""Container health check of a pdserve service; exit status 0 = healthy.

    pdserve-healthcheck grpc PORT     gRPC health of the server on this container's PORT
    pdserve-healthcheck http URL      HTTP 200 from URL (the gateway's /health)

gRPC servers here bind either 0.0.0.0 (bootstrap) or the container's own address (workers,
`--host auto`), so the check dials the container's address, which both answer on. The gRPC
check uses the standard grpc.health.v1 service every pdserve server exposes; the overall status
("" service) is SERVING once the server accepts RPCs.

A server started with TLS (PDSERVE_GRPC_TLS_CERT / _KEY / _CA in the container's environment, as
compose passes them) is probed over TLS with the same files: the container's own certificate is
the client certificate mutual TLS asks for. The certificate rarely names the container's address,
so the check first reads the names the server's certificate holds (one TLS handshake, verified
against the CA) and asks gRPC to expect the first of them.
"""

from __future__ import annotations

import os
import socket
import ssl
import sys
import urllib.error
import urllib.request

TIMEOUT_S = 4.0


def container_host() -> str:
    return os.environ.get("CONTAINER_HOST") or socket.gethostbyname(socket.gethostname())


def check_grpc(port: str) -> str | None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    host = container_host()
    target = f"{host}:{port}"
    tls = _tls_files()
    if tls is None:
        channel = grpc.insecure_channel(target)
    else:
        try:
            name = _certificate_name(host, int(port), tls)
        except (OSError, ssl.SSLError) as exc:
            return f"{target}: TLS handshake failed: {exc}"
        options = [("grpc.ssl_target_name_override", name)] if name else []
        channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(
            root_certificates=_read(tls["ca"]), private_key=_read(tls["key"]),
            certificate_chain=_read(tls["cert"])), options=options)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                              timeout=TIMEOUT_S)
        except grpc.RpcError as exc:
            return f"{target}: {exc.code().name} {exc.details()}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return f"{target}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
    return None


def _tls_files() -> dict[str, str] | None:
    files = {part: os.environ.get(f"PDSERVE_GRPC_TLS_{part.upper()}", "") for part in ("cert", "key", "ca")}
    return files if files["cert"] or files["ca"] else None


def _read(path: str) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as handle:
        return handle.read()


def _certificate_name(host: str, port: int, tls: dict[str, str]) -> str | None:
    """A name the server's certificate holds (DNS first, then IP), read in a verified handshake."""
    context = ssl.create_default_context(cafile=tls["ca"] or None)
    context.check_hostname = False  # the point is to learn the name; the chain is still verified
    if tls["cert"] and tls["key"]:
        context.load_cert_chain(tls["cert"], tls["key"])
    context.set_alpn_protocols(["h2"])
    with socket.create_connection((host, port), timeout=TIMEOUT_S) as raw, \
            context.wrap_socket(raw, server_hostname=None) as conn:
        names = conn.getpeercert().get("subjectAltName", ())
    for kind in ("DNS", "IP Address"):
        for found_kind, value in names:
            if found_kind == kind:
                return value
    return None


def check_http(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            return None if response.status == 200 else f"{url}: HTTP {response.status}"
    except urllib.error.HTTPError as exc:  # the gateway answers 503 until a (prefill, decode) pair can serve
        return f"{url}: HTTP {exc.code} {exc.read(300).decode(errors='replace')}"
    except (urllib.error.URLError, OSError) as exc:
        return f"{url}: {exc}"


def main(argv: list[str]) -> int:
    checks = {"grpc": check_grpc, "http": check_http}
    if len(argv) != 2 or argv[0] not in checks:
        print("usage: pdserve-healthcheck grpc PORT | http URL", file=sys.stderr)
        return 2
    problem = checks[argv[0]](argv[1])
    if problem:
        print(f"unhealthy: {problem}")
        return 1
    print("healthy")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
