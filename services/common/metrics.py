"""Prometheus endpoint of a service, on its own port, with a per-service CollectorRegistry.

Metric names follow the field's style `pdserve:<name>` (prometheus_client accepts ':' in metric
names). Each service builds its own `CollectorRegistry` instead of using the process-global
default, so tests can run several services in one process without duplicate-metric errors.

/metrics always answers in the Prometheus text format, whatever the scraper asks for.
Prometheus asks for OpenMetrics first, and prometheus_client's OpenMetrics writer escapes the `:`
of sample names to `_` (0.26: `pdserve_kv_pages_used`), so dashboards written against the names
the services define would find nothing. The gateway's /metrics route does the same.
"""

from __future__ import annotations

import socket
import socketserver
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

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


class _ThreadingWSGIServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper never blocks another, nor the process's exit


class _ThreadingWSGIServer6(_ThreadingWSGIServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # no access log line per scrape
        pass


def _metrics_app(registry: CollectorRegistry) -> Callable:
    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "/") not in ("/", "/metrics"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: metrics are at /metrics\n"]
        body = generate_latest(registry)
        start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST), ("Content-Length", str(len(body)))])
        return [body]
    return app


def start_metrics_server(registry: CollectorRegistry, port: int = 0,
                         host: str = "127.0.0.1") -> MetricsServer:
    """Serve `registry` on http://host:port/metrics from a daemon thread; port 0 picks a free port."""
    server_class = _ThreadingWSGIServer6 if ":" in host else _ThreadingWSGIServer
    httpd = make_server(host, port, _metrics_app(registry), server_class, handler_class=_QuietHandler)
    thread = threading.Thread(target=httpd.serve_forever, name="metrics-server", daemon=True)
    thread.start()
    return MetricsServer(registry=registry, host=host, port=httpd.server_port, _httpd=httpd, _thread=thread)
