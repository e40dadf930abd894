"""One worker's ranks across nodes (`--nnodes 2 --node-rank R --dist-init-addr HOST:PORT`), as the
seeds run DeepSeek-V3 (TP over two nodes) and DeepSeek-V3.1 (pipeline stages over nodes), scaled to
a tiny DeepSeek checkpoint on this machine.

Each node is its own host (a network namespace on a bridge, tests/e2e/hosts.py): the prefill's two
nodes, the decode's two nodes and the router (registry + gateway) bind and register only their own
addresses, and a prefill rank on one host writes its pages straight into the decode rank on
another. Greedy output equals HF transformers on mooncake and nixl. Killing a decode's second node
with -9 under load takes that worker out of the registry, the gateway serves on through the other
decode, no request hangs and every page is free again.

The refusals (a node that cannot reach the init address, a node started with other sizes) run on
loopback, without namespaces.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.e2e.cluster import Cluster, wait_until
from tests.e2e.hf import hf_greedy
from tests.e2e.hosts import HostNetwork
from tests.e2e.test_moe_mla_pd import NEW_TOKENS, assert_matches, prompts_of
from tests.e2e.worker_client import run_all
from tools.chaos.netns import NetnsUnavailable
from tools.models.tiny_model import write_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

LENGTHS = [1, 17, 70, 130]
INIT_PORT = "5000"  # each node is its own host: the seeds' port is free on every one


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("e2e-model") / "deepseek", preset="tiny-deepseek", seed=3)


@pytest.fixture
def hosts() -> Iterator[HostNetwork]:
    """Tests ask for it before `cluster`: fixtures are torn down in reverse order, so the processes
    stop while their network is still up (with the network gone first, each stop waited out its
    deregister's deadline, and some processes were SIGKILLed)."""
    try:
        network = HostNetwork.create(["router", "prefill0", "prefill1", "decode0", "decode1"])
    except NetnsUnavailable as exc:
        print(f"SKIPPED multi-node test: {exc}")
        pytest.skip(str(exc))
    with network:
        yield network


def worker_on(model, mode: str, host: str, backend: str, registry: str, *extra: str) -> list[str]:
    """A worker binding only `host`, registered with `registry`."""
    return ["launch-server", "--model-path", str(model), "--disaggregation-mode", mode, "--host", host,
            "--port", "0", "--metrics-port", "0", "--disaggregation-transfer-backend", backend, "--bootstrap",
            registry, "--num-threads", "1", "--num-pages", "96", "--chunked-prefill-size", "64", *extra]


# The seeds' layouts over two nodes, scaled: DeepSeek-V3's TP 16 (here TP 2, no RDMA device),
# DeepSeek-V3's `--tp-size 16 --dp-size 8 --enable-dp-attention --moe-a2a-backend deepep` (here TP 2
# in 2 DP attention groups, one per node, experts over both; DeepEP is absent on CPU: the torch
# all-to-all stands in, with a warning) and DeepSeek-V3.1's `--tp 8 --pp-size 4 --nnodes 4` (here
# `--tp 1 --pp-size 2 --nnodes 2`).
LAYOUTS = {"tp": ("--tp-size", "2"), "pp": ("--tp", "1", "--pp-size", "2"),
           "dp": ("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--moe-a2a-backend", "deepep")}


def seeds_node(model, mode: str, host: str, node0: str, node_rank: int, backend: str, registry: str,
               layout: str = "tp") -> list[str]:
    """The seeds' multi-node DeepSeek command line, scaled to two nodes of one rank each."""
    return worker_on(model, mode, host, backend, registry, "--trust-remote-code", "--dist-init-addr",
                     f"{node0}:{INIT_PORT}", "--nnodes", "2", "--node-rank", str(node_rank), *LAYOUTS[layout])


def start_two_node_worker(cluster: Cluster, hosts: HostNetwork, model, mode: str, backend: str, registry: str,
                          layout: str = "tp"):
    """Node 1 first (it waits for node 0's store), then node 0, ready once both nodes' ranks joined."""
    node0, node1 = hosts.hosts[f"{mode}0"], hosts.hosts[f"{mode}1"]
    second = cluster.spawn(f"{mode}-node1", seeds_node(model, mode, node1.address, node0.address, 1, backend,
                                                       registry, layout), wrapper=node1.wrapper)
    first = cluster.spawn(f"{mode}-node0", seeds_node(model, mode, node0.address, node0.address, 0, backend,
                                                      registry, layout), wrapper=node0.wrapper)
    return first, second


# Each layout and each backend in `make test`; the other two in `make test-all` (tests/e2e/matrix.py).
@pytest.mark.parametrize(("layout", "backend"), [pytest.param("tp", "mooncake", marks=pytest.mark.long),
                                                 ("tp", "nixl"), ("pp", "mooncake"),
                                                 pytest.param("dp", "mooncake", marks=pytest.mark.long),
                                                 ("dp", "nixl")])
def test_seeds_two_node_deepseek_matches_hf(hosts: HostNetwork, cluster: Cluster, deepseek, layout, backend):
    router = hosts.hosts["router"]
    registry = cluster.start("bootstrap", ["bootstrap", "--host", router.address, "--port", "0",
                                           "--metrics-port", "0"], wrapper=router.wrapper)
    prefill, prefill_node1 = start_two_node_worker(cluster, hosts, deepseek, "prefill", backend,
                                                   registry.address, layout)
    decode, decode_node1 = start_two_node_worker(cluster, hosts, deepseek, "decode", backend,
                                                 registry.address, layout)
    for proc in (prefill, decode):
        proc.wait_ready(240)
    assert (prefill.host, decode.host) == (hosts.hosts["prefill0"].address, hosts.hosts["decode0"].address)
    prompts = prompts_of(LENGTHS, seed=41)
    got = run_all(decode.address, prompts, [prefill.address] * len(prompts), max_new_tokens=NEW_TOKENS)
    assert_matches(got, hf_greedy(deepseek, prompts, NEW_TOKENS),
                   f"{backend} PD, {LAYOUTS[layout]} over two nodes each")
    # The prefill's rank on its second host wrote its share itself (MLA: decode rank 1's whole pages;
    # PP: its stage's layers; DP attention: the pages of the rooms its group prefilled).
    assert prefill.metric("pdserve:kv_transfer_rank_bytes", rank="1") > 0
    assert "transfer engines on " + hosts.hosts["prefill1"].address in prefill_node1.log()
    if layout == "dp":  # each node's group took requests; the seeds' DeepEP ran as the torch all-to-all
        for proc in (prefill, decode):
            assert all(proc.metric("pdserve:dp_rank_requests_total", dp_rank=g) > 0 for g in "01"), proc.name
        assert "--moe-a2a-backend deepep: DeepEP needs NVIDIA GPUs" in decode.log()

    gateway = cluster.start("gateway", ["launch-router", "--bootstrap", registry.address,
                                        "--host", router.address, "--port", "0"], wrapper=router.wrapper)
    wait_until(lambda: httpx.get(f"http://{gateway.address}/health", timeout=5).status_code == 200, 60,
               "the gateway to see both workers")
    client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    reply = client.chat.completions.create(model="deepseek",
                                           messages=[{"role": "user", "content": "Hello there"}],
                                           max_tokens=8, temperature=0)
    assert reply.usage.completion_tokens > 0
    for proc in (prefill, decode):
        wait_until(lambda proc=proc: proc.metric("pdserve:kv_pages_used") == 0, 30,
                   f"{proc.name}'s pages to be free")
    # A graceful stop of node 0 lets the other node's ranks leave cleanly.
    decode.kill(signal.SIGTERM)
    assert decode_node1.popen.wait(timeout=60) == 0, decode_node1.log()[-2000:]


def test_killed_second_node_takes_its_worker_out(hosts: HostNetwork, cluster: Cluster, deepseek):
    router = hosts.hosts["router"]
    registry = cluster.start("bootstrap", ["bootstrap", "--host", router.address, "--port", "0",
                                           "--metrics-port", "0"], wrapper=router.wrapper)
    prefill = cluster.spawn("prefill", worker_on(deepseek, "prefill", hosts.hosts["prefill0"].address,
                                                 "mooncake", registry.address),
                            wrapper=hosts.hosts["prefill0"].wrapper)
    decode, decode_node1 = start_two_node_worker(cluster, hosts, deepseek, "decode", "mooncake",
                                                 registry.address)
    spare = cluster.spawn("decode-spare", worker_on(deepseek, "decode", hosts.hosts["prefill1"].address,
                                                    "mooncake", registry.address),
                          wrapper=hosts.hosts["prefill1"].wrapper)
    for proc in (prefill, decode, spare):
        proc.wait_ready(240)
    gateway = cluster.start("gateway", ["launch-router", "--bootstrap", registry.address,
                                        "--host", router.address, "--port", "0", "--policy", "round_robin"],
                            wrapper=router.wrapper)
    wait_until(lambda: httpx.get(f"http://{gateway.address}/health", timeout=5).status_code == 200, 60,
               "the gateway to see the workers")
    client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", max_retries=0,
                           timeout=90)

    def ask(i: int) -> str:
        try:
            client.completions.create(model="deepseek", prompt=f"Count with me {i}:", max_tokens=48,
                                      temperature=0)
            return "ok"
        except openai.APIError as exc:  # a clear error is allowed for the requests on the killed node
            return f"error {type(exc).__name__}"

    with ThreadPoolExecutor(8) as pool:
        outcomes = pool.map(ask, range(16))
        time.sleep(1.0)
        decode_node1.kill(signal.SIGKILL)
        outcomes = list(outcomes)  # each returned within the client's timeout: no request hung
    wait_until(lambda: not decode.alive(), 30, "the decode worker to exit after its second node died")
    assert re.search(r"(node 1|tp rank 1) sent no heartbeat", decode.log()), decode.log()[-3000:]
    # The gateway routes around it: every later request is served by the spare decode.
    for i in range(4):
        assert ask(100 + i) == "ok"
    assert outcomes.count("ok") > 0, outcomes
    for proc in (prefill, spare):
        wait_until(lambda proc=proc: proc.metric("pdserve:kv_pages_used") == 0, 30,
                   f"{proc.name}'s pages to be free")


def _pdserve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_unreachable_init_address_is_named(deepseek):
    proc = _pdserve("launch-server", "--model-path", str(deepseek), "--tp-size", "2", "--nnodes", "2",
                    "--node-rank", "1", "--dist-init-addr", "127.0.0.1:9", "--dist-timeout", "3")
    assert proc.returncode == 2
    assert ("node 1 cannot reach node 0's rank group at --dist-init-addr 127.0.0.1:9"
            in proc.stdout + proc.stderr)


def test_node_started_with_other_sizes_is_refused(cluster: Cluster, deepseek):
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    common = ["launch-server", "--model-path", str(deepseek), "--port", "0", "--metrics-port", "0",
              "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{port}", "--dist-timeout", "8",
              "--num-threads", "1", "--num-pages", "32"]
    # Both through the launcher, so both start alike (forked, or both fresh): node 0 waits only
    # --dist-timeout for node 1, which must not still be importing torch when that runs out.
    node0 = cluster.spawn("node0", [*common, "--node-rank", "0", "--tp-size", "2"])
    node1 = cluster.spawn("node1", [*common, "--node-rank", "1", "--tp-size", "4"])
    assert node1.popen.wait(timeout=120) == 2, node1.log()[-3000:]
    assert "node 1 was started with --tp-size 4 but node 0 with --tp-size 2" in node1.log()
    # Node 0 waits --dist-timeout for the node that never joined, then says who was missing.
    assert node0.popen.wait(timeout=120) != 0
    assert "ranks 1..1 on nodes 1..1 join at --dist-init-addr" in node0.log(), node0.log()[-3000:]
