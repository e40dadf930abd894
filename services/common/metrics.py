"""Prometheus endpoint of a service, on its own port, with a per-service CollectorRegistry.

Metric names follow the field's style `pdserve:<name>` (prometheus_client accepts ':' in metric
names). Each service builds its own `CollectorRegistry` instead of using the process-global
default, so tests can run several services in one process without duplicate-metric errors.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

PREFIX = "pdserve:"


def metric_name(name: str) -> str:
    """`time_to_first_token_seconds` -> `pdserve:time_to_first_token_seconds`."""
    return PREFIX + name


@dataclass
class MetricsServer:
    """A running `/metrics` HTTP endpoint serving `registry`; `port` is the bound port."""

    registry: CollectorRegistry
    host: str
    port: int
    _httpd: WSGIServer = field(repr=False)
    _thread: threading.Thread = field(repr=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(registry: CollectorRegistry, port: int = 0, host: str = "127.0.0.1") -> MetricsServer:
    """Serve `registry` on http://host:port/metrics from a daemon thread; port 0 picks a free port."""
    httpd, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(registry=registry, host=host, port=httpd.server_port, _httpd=httpd, _thread=thread)
