"""The registry on etcd heals without an operator, as real processes: etcd + a registry on it +
prefill + decode + gateway. etcd is killed and started again, first on its data, then on a wiped
data dir (every record and lease gone): each time every worker is back in the registry, the
gateway sees both, and it serves. Skipped, saying why, only when no etcd binary is installed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from protos.v1 import bootstrap_pb2
from services.common.registry_client import RegistryClient
from tests.e2e.cluster import Cluster, wait_until, worker_args
from tests.e2e.test_etcd_registry import registered
from tests.services.bootstrap.etcd import run_etcd

pytestmark = [pytest.mark.e2e, pytest.mark.alone, pytest.mark.timeout(300)]

BOTH = {"prefill": 1, "decode": 1, "colocated": 0}
PROMPT = "The history of the city begins"


def watched(address: str) -> dict[str, str]:
    """worker id -> grpc address as a new Watch on the registry sees them (its view of etcd, where
    List reads etcd itself)."""
    async def ask() -> dict[str, str]:
        client = RegistryClient(address)
        seen: dict[str, str] = {}
        try:
            async for event in client.watch(reconnect=False):
                if event.type == bootstrap_pb2.WORKER_EVENT_TYPE_SYNCED:
                    return seen
                seen[event.worker.worker_id] = event.worker.grpc_address
        finally:
            await client.close()
        raise AssertionError("the watch ended before SYNCED")
    return asyncio.run(asyncio.wait_for(ask(), 10))


def test_etcd_restarted_on_its_data_or_wiped_heals_and_the_gateway_serves(
        cluster: Cluster, tiny_model: Path, tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    with run_etcd(tmp_path / "a") as etcd:
        ports = {"client_port": etcd.client_port, "peer_port": etcd.peer_port}
        # lease 0.5 s x 6 = 3 s
        registry = cluster.bootstrap("--registry-store", "etcd", "--etcd-endpoints", etcd.endpoint,
                                     "--etcd-cluster", "heal", "--heartbeat-interval", "0.5",
                                     "--heartbeat-max-failure", "6")
        prefill, decode = cluster.start_many(
            [("prefill", worker_args(str(tiny_model), "prefill", bootstrap=registry)),
             ("decode", worker_args(str(tiny_model), "decode", bootstrap=registry))], 180)
        gateway = cluster.start("gateway", ["launch-router", "--model-path", str(tiny_model), "--port", "0",
                                            "--bootstrap", registry.address])
        addresses = sorted([prefill.address, decode.address])

        def healed() -> bool:
            try:
                listed = registered(registry.address)
                return (sorted(listed.values()) == addresses and watched(registry.address) == listed
                        and httpx.get(f"http://{gateway.address}/health", timeout=5).json().get("workers")
                        == BOTH)
            except Exception:  # noqa: BLE001 - the registry refuses List while etcd is away
                return False

        def serves() -> str:
            answer = httpx.post(f"http://{gateway.address}/v1/completions", timeout=60,
                                json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
            assert answer.status_code == 200, answer.text
            return answer.json()["choices"][0]["text"]

        wait_until(healed, 60, "the registry and the gateway to see both workers")
        reference = serves()
        ids = set(registered(registry.address))

        etcd.proc.kill()
        etcd.proc.wait()
        with run_etcd(tmp_path / "a", **ports):  # same data: the leases survive
            wait_until(healed, 60, "both workers back after etcd restarted on its data")
            assert set(registered(registry.address)) == ids
            assert serves() == reference
        with run_etcd(tmp_path / "b", **ports):  # wiped: the workers register again by themselves
            wait_until(healed, 60, "both workers back after etcd restarted wiped")
            assert not set(registered(registry.address)) & ids
            assert serves() == reference
            for worker in (prefill, decode):
                assert "registering again" in worker.log()
            cluster.stop_all()  # while etcd is up: the workers deregister cleanly

