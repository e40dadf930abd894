"""The multi-host shape on one machine: registry, prefill, decode and gateway each on its own "host"
(a network namespace on a bridge, tests/e2e/hosts.py), each binding and registering only its own
address, the Mooncake transfer engines included. A chat request through the gateway gives the same
text as a colocated worker on this host, and the prefill really shipped KV bytes across.

The gateway's host has no checkpoint on its command line: it learns the model from the workers.
Skipped, with the reason printed, only where network namespaces cannot be made (not root, no
iproute2, no bridge support).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.cluster import Cluster, wait_until
from tests.e2e.hosts import HostNetwork
from tools.chaos.netns import NetnsUnavailable

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

PROMPTS = ("Tell me about the river.", "Write a poem about the sea, please.")


@pytest.fixture
def hosts() -> Iterator[HostNetwork]:
    """Tests ask for it before `cluster`: fixtures are torn down in reverse order, so the processes
    stop while their network is still up (with the network gone first, each stop waited out its
    deregister's deadline, and some processes were SIGKILLed)."""
    try:
        network = HostNetwork.create(["registry", "prefill", "decode", "gateway"])
    except NetnsUnavailable as exc:
        print(f"SKIPPED multi-host test: {exc}")
        pytest.skip(str(exc))
    with network:
        yield network


def _worker(model: Path, mode: str, host: str, *extra: str) -> list[str]:
    return ["launch-server", "--model-path", str(model), "--disaggregation-mode", mode, "--host", host,
            "--port", "0", "--metrics-port", "0", "--disaggregation-transfer-backend", "mooncake",
            "--num-threads", "1", "--num-pages", "128", *extra]


def _chat(address: str, content: str) -> str:
    client = openai.OpenAI(base_url=f"http://{address}/v1", api_key="unused", max_retries=0, timeout=120)
    chunks = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                            max_tokens=20, temperature=0, stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)


def test_four_hosts_serve_like_one(hosts: HostNetwork, cluster: Cluster, tiny_model: Path) -> None:
    registry_host, prefill_host, decode_host, gateway_host = (hosts.hosts[name] for name in
                                                              ("registry", "prefill", "decode", "gateway"))
    registry = cluster.start("bootstrap", ["bootstrap", "--host", registry_host.address, "--port", "0",
                                           "--metrics-port", "0"], wrapper=registry_host.wrapper)
    assert registry.host == registry_host.address
    prefill = cluster.spawn("prefill", _worker(tiny_model, "prefill", prefill_host.address, "--bootstrap",
                                               registry.address), wrapper=prefill_host.wrapper)
    decode = cluster.spawn("decode", _worker(tiny_model, "decode", decode_host.address, "--bootstrap",
                                             registry.address), wrapper=decode_host.wrapper)
    reference_worker = cluster.spawn("colocated", _worker(tiny_model, "null", "127.0.0.1"))
    for proc in (prefill, decode, reference_worker):
        proc.wait_ready(180)
    assert (prefill.host, decode.host) == (prefill_host.address, decode_host.address)
    gateway = cluster.start("gateway", ["launch-router", "--bootstrap", registry.address, "--host",
                                        gateway_host.address, "--port", "0", "--policy", "round_robin"],
                            wrapper=gateway_host.wrapper)
    reference = cluster.start("gateway-ref", ["launch-router", "--model-path", str(tiny_model), "--port", "0",
                                              "--worker", reference_worker.address])
    assert gateway.host == gateway_host.address

    # the hosts really are apart: the prefill's host cannot reach a port bound on this host's loopback
    probe = cluster.spawn("loopback-probe", ["launch-router", "--worker", reference_worker.address,
                                             "--port", "0", "--model-info-timeout", "3"],
                          wrapper=prefill_host.wrapper)
    assert probe.popen.wait(timeout=60) == 1 and "no worker reported its model" in probe.log()

    wait_until(lambda: httpx.get(f"http://{gateway.address}/health", timeout=5).status_code == 200, 60,
               "the gateway (on its own host) to see a prefill and a decode worker")
    for content in PROMPTS:
        text = _chat(gateway.address, content)
        assert text and text == _chat(reference.address, content)
    assert decode.metric("pdserve:request_success_total") == len(PROMPTS)
    assert prefill.metric("pdserve:kv_transfer_bytes_total") > 0  # KV crossed from host to host
    assert f"registered with {registry.address}" in decode.log()
