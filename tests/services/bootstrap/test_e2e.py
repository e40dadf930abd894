"""`pdserve bootstrap` as a real process, driven by grpcurl (reflection only, no .proto files) and by
RegistryClient for the heartbeat lease."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator

import pytest

from protos.v1 import bootstrap_pb2
from services.common.registry_client import RegistryClient
from tests.grpcurl import grpcurl
from tests.services.bootstrap.process import BootstrapProcess, start_bootstrap
from tests.services.bootstrap.workers import worker_info

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def worker_json(grpc_address: str, role: str, page_size: int) -> dict:
    layout = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "page_size": page_size, "dtype": "float32"}
    return {"worker": {
        "role": role, "model": "tiny", "grpc_address": grpc_address, "metrics_address": "127.0.0.1:9100",
        "kv_layout": layout,
        "transfer_endpoint": {"backend": "fake", "host": "127.0.0.1", "layout": layout,
                              "descriptor": "AAEC"},  # bytes are base64 in JSON
    }}


@pytest.fixture(scope="module")
def registry_process() -> Iterator[BootstrapProcess]:
    process = start_bootstrap("--heartbeat-interval", "30")
    try:
        yield process
    finally:
        process.stop()


def test_reflection_lists_and_describes_services(registry_process: BootstrapProcess) -> None:
    listed = grpcurl(registry_process.address, "list")
    assert listed.returncode == 0, listed.stderr
    assert set(listed.stdout.split()) == {
        "pdserve.v1.Bootstrap", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    described = grpcurl(registry_process.address, "describe", "pdserve.v1.Bootstrap")
    assert described.returncode == 0, described.stderr
    assert "rpc Watch ( .pdserve.v1.WatchRequest ) returns ( stream .pdserve.v1.WorkerEvent )" \
        in described.stdout
    assert "rpc Register ( .pdserve.v1.RegisterRequest ) returns ( .pdserve.v1.RegisterResponse )" \
        in described.stdout
    message = grpcurl(registry_process.address, "describe", "pdserve.v1.KVLayout")
    assert "int32 page_size = 4;" in message.stdout


def test_health_check(registry_process: BootstrapProcess) -> None:
    for service in ("", "pdserve.v1.Bootstrap"):
        checked = grpcurl(registry_process.address, "grpc.health.v1.Health/Check", body={"service": service})
        assert checked.returncode == 0, checked.stderr
        assert json.loads(checked.stdout) == {"status": "SERVING"}


def test_register_list_and_refusal_with_grpcurl(registry_process: BootstrapProcess) -> None:
    address = registry_process.address
    registered = grpcurl(address, "pdserve.v1.Bootstrap/Register",
                         body=worker_json("127.0.0.1:7001", "WORKER_ROLE_PREFILL", 16))
    assert registered.returncode == 0, registered.stderr
    reply = json.loads(registered.stdout)
    assert reply["worker_id"].startswith("prefill-")
    assert reply["lease"]["ttl_seconds"] == 60 and reply["lease"]["heartbeat_interval_seconds"] == 30

    listed = grpcurl(address, "pdserve.v1.Bootstrap/List", body={"role": "WORKER_ROLE_PREFILL"})
    assert listed.returncode == 0, listed.stderr
    [worker] = json.loads(listed.stdout)["workers"]
    assert worker["worker_id"] == reply["worker_id"]
    assert worker["grpc_address"] == "127.0.0.1:7001" and worker["kv_layout"]["page_size"] == 16
    assert worker["transfer_endpoint"]["descriptor"] == "AAEC"

    refused = grpcurl(address, "pdserve.v1.Bootstrap/Register",
                      body=worker_json("127.0.0.1:7002", "WORKER_ROLE_DECODE", 32))
    assert refused.returncode != 0
    assert "FailedPrecondition" in refused.stderr and "page_size: 32 vs 16" in refused.stderr

    expired = grpcurl(address, "pdserve.v1.Bootstrap/Heartbeat", body={"lease_id": "unknown"})
    assert expired.returncode != 0 and "NotFound" in expired.stderr

    with urllib.request.urlopen(f"http://127.0.0.1:{registry_process.metrics_port}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    assert 'pdserve:bootstrap_workers{role="prefill"} 1.0' in metrics
    assert 'pdserve:bootstrap_registrations_refused_total{reason="layout_mismatch"} 1.0' in metrics


def test_sigterm_shuts_down_cleanly() -> None:
    process = start_bootstrap()
    assert process.stop() == 0
    assert any("got SIGTERM: shutting down" in line for line in process.lines)


async def test_lease_expires_when_heartbeats_stop() -> None:
    # lease 0.2 s x 5: short, with slack for a busy machine delaying a heartbeat or two
    process = start_bootstrap("--heartbeat-interval", "0.2", "--heartbeat-max-failure", "5")
    try:
        worker = RegistryClient(process.address)
        gateway = RegistryClient(process.address)
        await worker.register(worker_info("127.0.0.1:7100"))
        worker.start_heartbeat()
        events = gateway.watch(reconnect=False)
        joined = await asyncio.wait_for(events.__anext__(), 10)
        assert (joined.type, joined.worker.worker_id) == (bootstrap_pb2.WORKER_EVENT_TYPE_JOINED,
                                                          worker.worker_id)
        assert (await asyncio.wait_for(events.__anext__(), 10)).type == bootstrap_pb2.WORKER_EVENT_TYPE_SYNCED

        await asyncio.sleep(2.5)  # 2.5 lease lifetimes: alive because heartbeats run
        assert [w.worker_id for w in await gateway.list()] == [worker.worker_id]

        await worker.stop_heartbeat()  # the worker hangs: no deregister, no heartbeat
        left = await asyncio.wait_for(events.__anext__(), 10)
        assert (left.type, left.worker.worker_id, left.reason) == (
            bootstrap_pb2.WORKER_EVENT_TYPE_LEFT, worker.worker_id, "lease expired")
        assert await gateway.list() == []
        await events.aclose()
        await gateway.close()
        await worker.close()  # its lease is gone: deregister logs and carries on
    finally:
        assert process.stop() == 0
