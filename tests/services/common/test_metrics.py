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


def test_metric_name() -> None:
    assert metric_name("time_to_first_token_seconds") == "pdserve:time_to_first_token_seconds"
