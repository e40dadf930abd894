#!/usr/bin/env python3
"""Container health check of a pdserve service; exit status 0 = healthy.

    pdserve-healthcheck grpc PORT     gRPC health of the server on this container's PORT
    pdserve-healthcheck http URL      HTTP 200 from URL (the gateway's /health)

gRPC servers here bind either 0.0.0.0 (bootstrap) or the container's own address (workers,
`--host auto`), so the check dials the container's address, which both answer on. The gRPC
check uses the standard grpc.health.v1 service every pdserve server exposes; the overall status
("" service) is SERVING once the server accepts RPCs.
"""

from __future__ import annotations

import os
import socket
import sys
import urllib.error
import urllib.request

TIMEOUT_S = 4.0


def container_host() -> str:
    return os.environ.get("CONTAINER_HOST") or socket.gethostbyname(socket.gethostname())


def check_grpc(port: str) -> str | None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = f"{container_host()}:{port}"
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                              timeout=TIMEOUT_S)
        except grpc.RpcError as exc:
            return f"{target}: {exc.code().name} {exc.details()}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return f"{target}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
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
