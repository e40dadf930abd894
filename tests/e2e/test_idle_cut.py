"""A gateway idle while a middlebox silently forgot its connections to a worker (an idle-cut: the
packets of the open gateway -> worker TCP connections dropped with no RST, in a network namespace)
serves its next request at once instead of waiting out TCP retransmissions: the keepalive pings
of its idle channel (services/common/keepalive.py) have found the connection dead, and the
request goes out on a fresh one. Real processes: a colocated worker in a namespace, the gateway
outside, statically pointed at it. Needs root, iproute2 and iptables; skipped, saying why, without.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.cluster import Cluster
from tools.chaos.netns import NetnsUnavailable, NetworkNamespace

pytestmark = [pytest.mark.e2e, pytest.mark.alone, pytest.mark.timeout(300)]

KEEPALIVE_S = 2.0  # PDSERVE_GRPC_KEEPALIVE_TIME of every process here: a dead peer is found in 3 s
IDLE_S = 4 * KEEPALIVE_S
REQUEST_TIMEOUT_S = 60.0  # the request's normal deadline: the test's only bound, never a timing check


@pytest.fixture
def netns() -> Iterator[NetworkNamespace]:
    try:
        namespace = NetworkNamespace.create()
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    with namespace:
        yield namespace


def complete(gateway: str) -> tuple[str, float]:
    """One greedy completion through the gateway: its text and how long it took (printed only)."""
    started = time.monotonic()
    answer = httpx.post(f"http://{gateway}/v1/completions", timeout=REQUEST_TIMEOUT_S,
                        json={"model": "tiny", "prompt": "The river runs", "max_tokens": 4, "temperature": 0})
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["text"], time.monotonic() - started


def test_first_request_after_an_idle_cut_is_served(cluster: Cluster, netns: NetworkNamespace,
                                                   tiny_model: Path) -> None:
    cluster.env["PDSERVE_GRPC_KEEPALIVE_TIME"] = str(KEEPALIVE_S)
    worker = cluster.start("colocated", [
        "launch-server", "--model-path", str(tiny_model), "--disaggregation-mode", "null",
        "--host", netns.inner_address, "--port", "0", "--metrics-port", "0", "--num-threads", "1"],
        wrapper=netns.wrapper)
    gateway = cluster.start("gateway", ["launch-router", "--model-path", str(tiny_model), "--port", "0",
                                        "--worker", worker.address])
    reference, _ = complete(gateway.address)
    port = int(worker.address.rpartition(":")[2])

    # the forgotten connections stay dead (the middlebox drops them for good): only a new one works
    assert netns.cut_idle_flows(port) >= 1
    time.sleep(IDLE_S)
    text, first_s = complete(gateway.address)
    assert text == reference
    print(f"idle-cut, old connections still dropped: first request after {IDLE_S:.0f}s idle "
          f"took {first_s:.2f}s")
    netns.restore_idle_flows()

    # the cut lifted before the next request (the brief's order: drop, idle, remove the rule, send)
    complete(gateway.address)
    assert netns.cut_idle_flows(port) >= 1
    time.sleep(IDLE_S)
    netns.restore_idle_flows()
    text, first_s = complete(gateway.address)
    assert text == reference
    print(f"idle-cut, rule removed before the request: first request after {IDLE_S:.0f}s idle "
          f"took {first_s:.2f}s")
