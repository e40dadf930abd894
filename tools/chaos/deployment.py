"""One PD deployment under test: bootstrap registry, 2 prefill, 2 decode and the gateway, each a real
process on free ports, for one transfer backend.

Every process binds `host` (127.0.0.1), except in the network scenario's deployment: there one worker
runs inside a network namespace bound to the namespace's address, and the rest bind the address this
side of the veth link so that the isolated worker can reach them. Services that are killed are
started again with the same arguments: workers on new ports (they register anew; the prefill-restart
scenario puts one back on its old gRPC port), the registry and the gateway on their old ports (workers
and clients know those addresses).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tools.bench.serving.mooncake_master import MasterProcess
from tools.chaos.config import ChaosConfig
from tools.chaos.etcd import EtcdProcess
from tools.chaos.lifecycle import stop, until_ready
from tools.chaos.netns import NetworkNamespace
from tools.launch import ProcessGroup, Service

PREFILLS = ("prefill-0", "prefill-1")
DECODES = ("decode-0", "decode-1")


def role_of(worker_name: str) -> str:
    return worker_name.split("-")[0]


@dataclass
class Deployment:
    """The services of one deployment, by name; `workers` maps prefill-0 .. decode-1 to their current
    process (a restart replaces the entry). `isolated` names the worker inside `netns`, if any."""

    backend: str
    config: ChaosConfig
    group: ProcessGroup
    host: str = "127.0.0.1"
    netns: NetworkNamespace | None = None
    isolated: str | None = None
    bootstrap: Service | None = None
    gateway: Service | None = None
    workers: dict[str, Service] = field(default_factory=dict)
    etcd: EtcdProcess | None = None  # with --registry-store etcd: the registry's store
    store: MasterProcess | None = None  # a Mooncake Store master: every worker uses the KV store tier

    @property
    def model_name(self) -> str:
        return Path(self.config.model_path).resolve().name

    @property
    def url(self) -> str:
        assert self.gateway is not None
        return f"http://{self.gateway.address}"

    def services(self) -> list[Service]:
        """Every current service: registry, workers, gateway."""
        return [s for s in (self.bootstrap, *self.workers.values(), self.gateway) if s is not None]

    # -- arguments ------------------------------------------------------------------------------

    def bootstrap_args(self, port: int = 0) -> list[str]:
        return ["bootstrap", "--host", self.host, "--port", str(port), "--metrics-port", "0",
                *self.registry_store_args()]

    def gateway_args(self, port: int = 0) -> list[str]:
        assert self.bootstrap is not None
        return ["launch-router", "--model-path", self.config.model_path,
                "--bootstrap", self.bootstrap.address, "--host", self.host, "--port", str(port),
                "--prefill-policy", self.config.prefill_policy, "--decode-policy", self.config.decode_policy]

    def worker_args(self, name: str, port: int = 0) -> tuple[list[str], tuple[str, ...]]:
        """`pdserve` arguments of worker `name` (gRPC on `port`, 0: a free one), and the wrapper it runs
        under (the namespace's, if isolated)."""
        assert self.bootstrap is not None
        inside = self.netns is not None and name == self.isolated
        host = self.netns.inner_address if inside else self.host
        args = ["launch-server", "--model-path", self.config.model_path,
                "--disaggregation-mode", role_of(name), "--disaggregation-transfer-backend", self.backend,
                "--host", host, "--port", str(port), "--metrics-port", "0",
                "--bootstrap", self.bootstrap.address, "--num-pages", str(self.config.num_pages),
                "--num-threads", "1"]
        if self.store is not None:
            args += ["--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake",
                     "--hicache-mooncake-master", self.store.address, "--hicache-mooncake-segment-mb", "32"]
        return args, (self.netns.wrapper if inside else ())

    # -- starting -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Registry, then the four workers at once (model loading overlaps), then the gateway; returns
        once the gateway sees all four workers and says it can serve."""
        timeout = self.config.ready_timeout
        await self.start_etcd()
        self.bootstrap = await until_ready(self.group.spawn("bootstrap", self.bootstrap_args()), timeout)
        for name in (*PREFILLS, *DECODES):
            args, wrapper = self.worker_args(name)
            self.workers[name] = self.group.spawn(name, args, wrapper=wrapper)
        for worker in self.workers.values():
            await until_ready(worker, timeout)
        self.gateway = await until_ready(self.group.spawn("gateway", self.gateway_args()), timeout)
        if not await self.wait_gateway_sees_all(timeout):
            raise RuntimeError(f"{self.backend}: the gateway did not see 2 prefill + 2 decode workers "
                               f"within {timeout:.0f}s")

    async def restart_worker(self, name: str, same_address: bool = False) -> Service:
        """Start worker `name` again (its process must be gone): on new ports, or with `same_address`
        on its old host and gRPC port, so that peers meet a new process at an address they know."""
        old = self.workers[name]
        assert not old.alive(), f"{name} must be stopped before it is restarted"
        args, wrapper = self.worker_args(name, old.port if same_address else 0)
        self.workers[name] = await until_ready(self.group.spawn(name, args, wrapper=wrapper),
                                               self.config.ready_timeout)
        return self.workers[name]

    async def restart_bootstrap(self) -> Service:
        """Start the registry again on its old port (every worker and the gateway dial that address)."""
        assert self.bootstrap is not None and not self.bootstrap.alive()
        restarted = self.group.spawn("bootstrap", self.bootstrap_args(self.bootstrap.port))
        self.bootstrap = await until_ready(restarted, self.config.ready_timeout)
        return self.bootstrap

    async def restart_gateway(self) -> Service:
        """Start the gateway again on its old port (clients keep their URL)."""
        assert self.gateway is not None and not self.gateway.alive()
        self.gateway = await until_ready(self.group.spawn("gateway", self.gateway_args(self.gateway.port)),
                                         self.config.ready_timeout)
        return self.gateway

    # -- the registry's etcd (--registry-store etcd) ----------------------------------------------

    def registry_store_args(self) -> list[str]:
        if self.config.registry_store != "etcd":
            return []
        assert self.etcd is not None
        return ["--registry-store", "etcd", "--etcd-endpoints", self.etcd.endpoint, "--etcd-cluster", "chaos"]

    async def start_etcd(self, *, wipe: bool = False) -> None:
        """Start the registry's etcd (first start, or again on the same ports after a kill; `wipe`:
        on an empty data dir). Its process joins the group, which stops it after everything else."""
        if self.config.registry_store != "etcd":
            return
        if self.etcd is None:
            self.etcd = EtcdProcess.on_free_ports(self.host, self.group.workdir)
        await self.etcd.start(wipe=wipe)
        assert self.etcd.popen is not None
        self.group.procs.insert(0, Service("etcd", [], self.etcd.popen, self.etcd.log_path))

    async def stop_all(self) -> None:
        """Gateway first (no new requests), then workers, the registry last."""
        for service in reversed(self.services()):
            await stop(service)

    # -- the gateway's view ---------------------------------------------------------------------

    async def health(self) -> tuple[int, dict]:
        """The gateway's /health status and body; (0, {}) when it does not answer."""
        try:
            async with httpx.AsyncClient(timeout=3) as http:
                response = await http.get(f"{self.url}/health")
            return response.status_code, response.json()
        except (httpx.HTTPError, ValueError):
            return 0, {}

    async def wait_gateway_sees_all(self, timeout_s: float) -> bool:
        """Until /health is 200 and counts both prefill and both decode workers."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status, body = await self.health()
            seen = body.get("workers", {})
            if (status == 200 and seen.get("prefill", 0) >= len(PREFILLS)
                    and seen.get("decode", 0) >= len(DECODES)):
                return True
            await asyncio.sleep(0.2)
        return False
