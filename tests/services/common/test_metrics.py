"""Two metrics servers with their own registries in one process, `pdserve:` names, port 0."""

from __future__ import annotations

import urllib.request

from prometheus_client import CollectorRegistry, Counter, Histogram

from services.common.metrics import metric_name, start_metrics_server


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def test_two_servers_two_registries() -> None:
    first, second = CollectorRegistry(), CollectorRegistry()
    # the same metric name in both: fine, because neither uses the global default registry
    Counter(metric_name("requests"), "requests served", registry=first).inc(3)
    Counter(metric_name("requests"), "requests served", registry=second).inc(5)
    Histogram(metric_name("time_to_first_token_seconds"), "TTFT", registry=first).observe(0.25)
    servers = [start_metrics_server(first), start_metrics_server(second)]
    try:
        assert servers[0].port != servers[1].port and all(s.port > 0 for s in servers)
        text = scrape(servers[0].port)
        assert "pdserve:requests_total 3.0" in text
        assert 'pdserve:time_to_first_token_seconds_bucket{le="0.25"} 1.0' in text
        assert "pdserve:requests_total 5.0" in scrape(servers[1].port)
    finally:
        for server in servers:
            server.stop()


def test_text_format_even_when_openmetrics_is_asked_for() -> None:
    """Prometheus asks for OpenMetrics; prometheus_client's writer would turn `pdserve:` into `pdserve_`."""
    registry = CollectorRegistry()
    Counter(metric_name("requests"), "requests served", registry=registry).inc()
    server = start_metrics_server(registry)
    try:
        request = urllib.request.Request(f"http://127.0.0.1:{server.port}/metrics", headers={
            "Accept": "application/openmetrics-text;version=1.0.0,"
                      "application/openmetrics-text;version=0.0.1;q=0.75,"
                      "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.headers["Content-Type"].startswith("text/plain")
            assert "pdserve:requests_total 1.0" in response.read().decode()
    finally:
        server.stop()


def test_metric_name() -> None:
    assert metric_name("time_to_first_token_seconds") == "pdserve:time_to_first_token_seconds"
